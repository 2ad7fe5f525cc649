"""Deterministic train/validation split by document, for the embedded corpus and for `meshlm
prepare`.

A document is held out for validation when a hash of its id falls below the validation fraction, so
the split depends only on document ids: not on the order documents are read in, the machine or the
process. Splitting by document (not by token position) keeps any one text entirely on one side.

Two guarantees need one look at all ids first: with >= 2 documents and a fraction > 0, validation
gets at least one document (the lowest hash) and training keeps at least one (the highest hash).
`SplitPlan` takes that look in O(1) memory (counts plus the two extreme ids), so it also works on
streamed corpora.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from meshlm.errors import DataError

TRAIN, VAL = "train", "val"
SPLITS = (TRAIN, VAL)


def doc_score(doc_id: str) -> float:
    """A uniform number in [0, 1) fixed by the id (first 64 bits of its SHA-256)."""
    digest = hashlib.sha256(b"meshlm-split:" + doc_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


@dataclass
class SplitPlan:
    """Counts and extreme ids seen by `add`; `split_of` then assigns each id to TRAIN or VAL."""

    fraction: float
    n_docs: int = 0
    n_val: int = 0  # documents whose score alone puts them in validation
    lowest: tuple[float, str] | None = None
    highest: tuple[float, str] | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction < 1.0:
            raise DataError(f"validation fraction {self.fraction} is outside [0, 1); use e.g. 0.02")

    def add(self, doc_id: str) -> None:
        score = doc_score(doc_id)
        self.n_docs += 1
        self.n_val += score < self.fraction
        if self.lowest is None or (score, doc_id) < self.lowest:
            self.lowest = (score, doc_id)
        if self.highest is None or (score, doc_id) > self.highest:
            self.highest = (score, doc_id)

    def split_of(self, doc_id: str) -> str:
        guaranteed = self.n_docs >= 2 and self.fraction > 0
        if guaranteed and self.n_val == 0 and doc_id == self.lowest[1]:
            return VAL
        if guaranteed and self.n_val == self.n_docs and doc_id == self.highest[1]:
            return TRAIN
        return VAL if doc_score(doc_id) < self.fraction else TRAIN


def plan_split(doc_ids: Iterable[str], fraction: float) -> SplitPlan:
    plan = SplitPlan(fraction)
    for doc_id in doc_ids:
        plan.add(doc_id)
    return plan
