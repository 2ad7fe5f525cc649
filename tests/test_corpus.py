"""The embedded corpus (size, content, split by document) and the split rule itself."""
from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from meshlm.data.corpus import VAL_FRACTION, default_documents, split_documents
from meshlm.data.split import TRAIN, VAL, plan_split
from meshlm.errors import DataError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return list(default_documents())


def test_corpus_is_at_least_10_mb_of_real_documents(docs):
    assert sum(len(d["text"].encode("utf-8")) for d in docs) >= 10_000_000
    ids = [d["id"] for d in docs]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert {d["source"] for d in docs} == {"shakespeare", "milton", "web"}
    assert all(d["text"].strip() and d["id"].startswith(d["source"] + "/") for d in docs)
    by_id = {d["id"]: d["text"] for d in docs}
    assert "To be, or not to be" in by_id["shakespeare/hamlet"]
    assert "In the beginning, God created the heavens and the earth." in by_id["web/Gen"]
    assert "<" not in by_id["web/Gen"]  # OSIS markup stripped


def test_split_is_disjoint_covering_and_about_3_percent_of_text(docs):
    train = [d["id"] for d in split_documents(TRAIN)]
    val = [d["id"] for d in split_documents(VAL)]
    assert train and val and not set(train) & set(val)
    assert sorted(train + val) == [d["id"] for d in docs]
    val_chars = sum(len(d["text"]) for d in docs if d["id"] in set(val))
    assert 0.02 <= val_chars / sum(len(d["text"]) for d in docs) <= 0.05


def test_split_is_deterministic_and_order_independent(docs):
    ids = [d["id"] for d in docs]
    shuffled = ids[:]
    random.Random(1).shuffle(shuffled)
    plan_a, plan_b = plan_split(ids, VAL_FRACTION), plan_split(shuffled, VAL_FRACTION)
    assert [plan_a.split_of(i) for i in ids] == [plan_b.split_of(i) for i in ids]
    assert [d["id"] for d in split_documents(VAL)] == [i for i in ids if plan_a.split_of(i) == VAL]


def test_split_guarantees_both_sides_with_two_or_more_documents():
    few = plan_split(["a", "b"], 1e-9)  # no hash falls this low: the lowest-hash id is moved to val
    assert sorted(few.split_of(i) for i in "ab") == [TRAIN, VAL]
    # all hash into val: one is kept for train
    most = plan_split([str(i) for i in range(5)], 0.999999)
    assert sorted(most.split_of(str(i)) for i in range(5)).count(TRAIN) == 1
    assert plan_split(["only"], 0.5).split_of("only") in (TRAIN, VAL)
    assert {plan_split(["a", "b"], 0.0).split_of(i) for i in "ab"} == {TRAIN}  # 0 = no validation


@pytest.mark.parametrize("fraction", [-0.1, 1.0, 2.0])
def test_split_rejects_bad_fractions(fraction):
    with pytest.raises(DataError, match="validation fraction"):
        plan_split(["a"], fraction)


def load_build_script():
    spec = importlib.util.spec_from_file_location("build_corpus",
                                                  ROOT / "scripts" / "build_corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_osis_markup_becomes_plain_verses():
    build = load_build_script()
    osis = ('<div osisID="Hos" sID="g1" type="book"/><title type="main">Hosea</title> <w '
            'lemma="x">Yahweh’s</w><note placement="foot">a note</note><w>word</w> '
            'came<note>n</note>. A &amp; B')
    assert build.osis_to_text(osis) == "Hosea\nYahweh’s word came. A & B"
    parts = build.START.split('intro <chapter osisID="Hos.2" sID="Hos.2"/> verse')
    assert parts == ["intro ", '<chapter osisID="Hos.2" sID="Hos.2"/>', "Hos", " verse"]
