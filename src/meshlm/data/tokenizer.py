"""Tokenizers: the shipped 8192-token byte-level BPE, Pythia's GPT-NeoX-20B tokenizer, or any
tokenizer.json.

All three load from local files (HF `tokenizers` JSON); nothing here touches the network. "pythia"
reads the copy that `meshlm fetch` extracted into the cache (see meshlm.data.fetch).

Both named tokenizers follow Pythia's convention: `<|endoftext|>` = id 0 ends every document (and
separates documents in the token stream), `<|padding|>` = id 1. A user tokenizer needs an
end-of-text token under one of EOS_NAMES; its padding id falls back to the EOS id.

`TextTokenizer` wraps the HF object with the few operations meshlm needs and a hash of what it does
(`behaviour_hash`: vocabulary, merges, normalisation, pre-tokenisation, special tokens, decoding,
not the file's bytes), which prepared data records and which keys caches: a tokenizer.json exported
again (other formatting, key order or library version) is the same tokenizer; one that encodes
differently is not. `decode` keeps special tokens, so decode(encode(s)) == s for byte-level BPE
(Pythia's tokenizer also NFC-normalises, so only NFC text round-trips there).
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from meshlm.data.fetch import pythia_tokenizer_path
from meshlm.errors import ConfigError, DataError

DEFAULT_PATH = Path(__file__).parents[1] / "assets" / "tokenizer-8192.json"
DEFAULT_VOCAB = 8192
EOS_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|padding|>"
EOS_NAMES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
_BEHAVIOUR: dict[str, str] = {}  # file hash -> behaviour hash: one tokenizer file is serialised
# once


class TextTokenizer:
    """A loaded tokenizer: encode/decode plus the ids and identity that data preparation records."""

    def __init__(self, tokenizer: Tokenizer, name: str, file_hash: str):
        self.hf = tokenizer
        self.name = name
        # first 16 hex digits of the file's SHA-256 (what data prepared before meshlm recorded
        # behaviour hashes holds)
        self.file_hash = file_hash
        self.vocab_size = tokenizer.get_vocab_size()  # with added tokens: the largest id + 1
        eos = next((tokenizer.token_to_id(t) for t in EOS_NAMES
                    if tokenizer.token_to_id(t) is not None), None)
        if eos is None:
            raise DataError(f"tokenizer {name} has no end-of-text token (one of "
                            f"{', '.join(EOS_NAMES)}); add one")
        self.eos_id = eos
        pad = tokenizer.token_to_id(PAD_TOKEN)
        self.pad_id = eos if pad is None else pad

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encodes in parallel (Rust threads); skips offsets, which meshlm never needs."""
        return [enc.ids for enc in self.hf.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    @property
    def hash(self) -> str:
        """What it does (behaviour_hash): equal for re-exported copies of one tokenizer. Computed on
        first use, once per file content in a process (~40 ms for 8,192 ids)."""
        if self.file_hash not in _BEHAVIOUR:
            _BEHAVIOUR[self.file_hash] = behaviour_hash(self.hf)
        return _BEHAVIOUR[self.file_hash]

    def made(self, recorded: dict) -> bool:
        """Whether prepared data's manifest entry {"hash": ...} was tokenised by this tokenizer."""
        return recorded.get("hash") in (self.hash, self.file_hash)

    def __repr__(self) -> str:
        return f"TextTokenizer({self.name!r}, vocab_size={self.vocab_size}, hash={self.hash})"


# what a tokenizer.json holds besides its behaviour: the format version, and truncation/padding
# settings meshlm never uses (it encodes without them)
_NOT_BEHAVIOUR = ("version", "truncation", "padding")
_PARTS = {"model.vocab": "vocabulary", "model.merges": "merges", "model": "model settings",
          "normalizer": "normalisation", "pre_tokenizer": "pre-tokenisation",
          "added_tokens": "special tokens",
          "post_processor": "post-processing", "decoder": "decoding"}


def behaviour_spec(tokenizer: Tokenizer) -> dict:
    """The tokenizer as the library serialises it (so any file's formatting is gone), less what does
    not change encoding or decoding; added tokens in id order."""
    spec = json.loads(tokenizer.to_str())
    for key in _NOT_BEHAVIOUR:
        spec.pop(key, None)
    spec["added_tokens"] = sorted(spec.get("added_tokens") or [], key=lambda token: token["id"])
    return spec


def behaviour_hash(tokenizer: Tokenizer) -> str:
    canonical = json.dumps(behaviour_spec(tokenizer), sort_keys=True, separators=(",", ":"),
                           ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def differences(a: TextTokenizer, b: TextTokenizer) -> list[str]:
    """What two tokenizers do differently, in words (e.g. ["vocabulary", "merges"]); [] if
    nothing."""
    spec_a, spec_b = behaviour_spec(a.hf), behaviour_spec(b.hf)
    model_a, model_b = spec_a.pop("model", {}), spec_b.pop("model", {})
    parts = {f"model.{key}": (model_a.pop(key, None), model_b.pop(key, None))
             for key in ("vocab", "merges")}
    parts["model"] = (model_a, model_b)
    parts.update({key: (spec_a.get(key), spec_b.get(key))
                  for key in sorted(set(spec_a) | set(spec_b))})
    return [_PARTS.get(key, key) for key, (x, y) in parts.items() if x != y]


def resolve_tokenizer_path(name_or_path: str | os.PathLike,
                           cache_dir: str | os.PathLike | None = None) -> Path:
    """"default" -> the shipped BPE, "pythia" -> the fetched copy, anything else -> an existing
    file."""
    if str(name_or_path) == "default":
        return DEFAULT_PATH
    if str(name_or_path) == "pythia":
        return pythia_tokenizer_path(cache_dir)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"tokenizer {str(name_or_path)!r} is not 'default', 'pythia' or a "
                          "tokenizer.json file; "
                        f"check the name or path")
    return path


def tokenizer_file(name_or_path: str | os.PathLike) -> Path | None:
    """The tokenizer.json a checkpoint carries for `name_or_path` (so it stands alone); None for
    "default", which every meshlm install has."""
    if str(name_or_path) == "default":
        return None
    return resolve_tokenizer_path(name_or_path)


def load_tokenizer(name_or_path: str | os.PathLike = "default",
                   cache_dir: str | os.PathLike | None = None) -> TextTokenizer:
    """Load "default", "pythia" (after `meshlm fetch`) or a tokenizer.json path (or a folder holding
    one)."""
    path = resolve_tokenizer_path(name_or_path, cache_dir)
    raw = path.read_bytes()
    try:
        hf = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as err:  # tokenizers raises a bare Exception on malformed JSON
        raise DataError(f"{path} is not a valid tokenizers JSON file ({str(err)[:80]}); "
                        f"pass a tokenizer.json") from None
    name = str(name_or_path) if str(name_or_path) in ("default", "pythia") else str(path)
    return TextTokenizer(hf, name, hashlib.sha256(raw).hexdigest()[:16])


def check_vocab(model_vocab_size: int, tokenizer: TextTokenizer) -> None:
    """A model can embed more ids than the tokenizer makes (Pythia pads 50,277 to 50,304), never
    fewer."""
    if tokenizer.vocab_size > model_vocab_size:
        raise ConfigError(f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids but the "
                          "model's vocabulary "
                        f"has {model_vocab_size}; set the model vocab_size to at least "
                        f"{tokenizer.vocab_size}")


def train_bpe(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB) -> Tokenizer:
    """A byte-level BPE (GPT-2 style pre-tokenisation, no prefix space) with ids 0/1 =
    EOS/padding."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN, PAD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


TEMPLATE_FILE = "chat_template.jinja"  # where Hugging Face folders keep a chat template


def folder_chat_template(*folders: str | os.PathLike | None) -> str | None:
    """A model folder's own chat template, as Hugging Face folders carry it: chat_template.jinja,
    else tokenizer_config.json's "chat_template" (a string, or transformers' named list: its
    "default" entry); of several folders (a checkpoint, then its run, where `meshlm finetune`
    records the template its data were rendered in), the first that has one. None when none has.
    Fine-tuning (meshlm.data.sft) and serving (meshlm.serve.text) both read it."""
    return next((t for f in folders if f is not None and (t := _own_template(Path(f)))), None)


def _own_template(folder: Path) -> str | None:
    jinja = folder / TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    config = folder / "tokenizer_config.json"
    try:
        template = (json.loads(config.read_text(encoding="utf-8")).get("chat_template")
                    if config.is_file() else None)
    except (OSError, ValueError):
        return None
    if isinstance(template, list):  # [{"name": "default", "template": …}, …]
        template = next((t.get("template") for t in template if isinstance(t, dict)
                         and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) and template else None

