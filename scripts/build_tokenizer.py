#!/usr/bin/env python
"""Train the shipped tokenizer, src/meshlm/assets/tokenizer-8192.json (developer tool, not run by
users).

A byte-level BPE with 8192 ids (0 = <|endoftext|>, 1 = <|padding|>) trained on the TRAIN split of
the embedded corpus only, so validation loss on the default data is not measured on text the
tokenizer saw. The training is deterministic: rerunning it on the same corpus writes a
byte-identical file.

Usage: python scripts/build_tokenizer.py [--out PATH] [--vocab-size 8192]
"""
from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

from meshlm.data.corpus import split_documents
from meshlm.data.tokenizer import DEFAULT_PATH, DEFAULT_VOCAB, train_bpe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_PATH)
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB)
    args = parser.parse_args()
    tok = train_bpe((doc["text"] for doc in split_documents("train")), args.vocab_size)
    assert tok.get_vocab_size() == args.vocab_size, tok.get_vocab_size()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out))
    digest = hashlib.sha256(args.out.read_bytes()).hexdigest()[:16]
    print(f"{args.out}: vocab {tok.get_vocab_size()}, {args.out.stat().st_size / 1e3:.0f} kB, "
          f"sha256 {digest}")


if __name__ == "__main__":
    main()
