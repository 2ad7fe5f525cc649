"""The reasoning suite's character tokenizer: one id per character of the tasks' alphabets.

ids 0 and 1 are `<|endoftext|>` and `<|padding|>` (meshlm's convention, meshlm.data.tokenizer), then
every character of the alphabet in sorted order. It is an ordinary tokenizers JSON file (a WordLevel
model over single characters, its decoder joining them back), so everything that loads a
tokenizer.json loads it, and the same alphabet always gives the same file (and so the same hash).
"""
from __future__ import annotations

import os

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from meshlm import atomic
from meshlm.data.tokenizer import EOS_TOKEN, PAD_TOKEN, TextTokenizer, load_tokenizer

TOKENIZER_FILE = "tokenizer.json"
UNK_TOKEN = "<|unk|>"


def build_tokenizer(alphabet: str) -> Tokenizer:
    chars = sorted(set(alphabet))
    vocab = {EOS_TOKEN: 0, PAD_TOKEN: 1, UNK_TOKEN: 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([EOS_TOKEN, PAD_TOKEN, UNK_TOKEN])
    return tok


def write_tokenizer(path: str | os.PathLike, alphabet: str) -> TextTokenizer:
    """Write the alphabet's tokenizer to `path` and load it back (its hash is the file's)."""
    return load_tokenizer(atomic.write_text(path, build_tokenizer(alphabet).to_str()))
