"""The embedded default corpus: ~11 MB of public-domain English shipped inside the package.

`assets/corpus.jsonl.xz` (built by scripts/build_corpus.py; sources and licences in
assets/README.md) holds one JSON object per document, {"id", "source", "text"}: Shakespeare's works,
Milton's works and the World English Bible (one document per book). It lets `meshlm train` run with
no download at all.

The validation split is by document (see meshlm.data.split). VAL_FRACTION = 0.05 of the 131
documents holds out 7 of them, about 3% of the text, from all three sources.
"""
from __future__ import annotations

import functools
import hashlib
import json
import lzma
from collections.abc import Iterator
from pathlib import Path

from meshlm.data.split import SPLITS, SplitPlan, plan_split

CORPUS_PATH = Path(__file__).parents[1] / "assets" / "corpus.jsonl.xz"
VAL_FRACTION = 0.05


def default_documents() -> Iterator[dict]:
    """Every embedded document, sorted by id: {"id": str, "source": str, "text": str}."""
    with lzma.open(CORPUS_PATH, "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


@functools.lru_cache(maxsize=1)
def corpus_fingerprint() -> str:
    """Content hash of the asset: keys caches of data prepared from it."""
    return hashlib.sha256(CORPUS_PATH.read_bytes()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def default_split_plan() -> SplitPlan:
    return plan_split((doc["id"] for doc in default_documents()), VAL_FRACTION)


def split_documents(split: str) -> Iterator[dict]:
    """The embedded documents of one split, "train" or "val" (disjoint; together all documents)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    plan = default_split_plan()
    return (doc for doc in default_documents() if plan.split_of(doc["id"]) == split)
