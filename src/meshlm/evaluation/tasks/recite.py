"""`meshlm_recite`: a generative lm-eval task shipped with meshlm, offline by construction: continue
a line of verse from the embedded corpus (meshlm.data.corpus: Shakespeare and Milton), given the
line before it and the first half of the line, up to the end of the line; scored by exact match. It
is what `meshlm eval
--tasks meshlm_recite` and `lm_eval --include_path <meshlm>/evaluation/tasks/local --tasks
meshlm_recite` run without any download. The lines are from the corpus the default model trains on,
so it measures recitation (and checks that generative evaluation works end to end), not
generalisation.
"""
from __future__ import annotations

from pathlib import Path

from meshlm.data.corpus import default_documents

# the shipped task YAMLs (an lm-eval include path)
FOLDER = Path(__file__).resolve().parent / "local"
ITEMS = 200  # lines, spread evenly over the verse


def verse_items(n: int = ITEMS) -> list[dict[str, str]]:
    """`n` items {"prompt", "target"}, evenly spaced over every verse line of 6 to 14 words that
    follows a non-empty line, in document order."""
    candidates = []
    for doc in default_documents():
        if doc["source"] not in ("shakespeare", "milton"):
            continue
        lines = [line.strip() for line in doc["text"].splitlines()]
        for before, line in zip(lines, lines[1:]):
            words = line.split()
            if before and 6 <= len(words) <= 14:
                half = len(words) // 2
                candidates.append({"prompt": f"{before}\n{' '.join(words[:half])}",
                                   "target": " " + " ".join(words[half:])})
    step = max(1, len(candidates) // n)
    return candidates[::step][:n]


def dataset(**_):
    """The task's data for lm-eval's `custom_dataset` (a DatasetDict with one `test` split)."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(verse_items())})
