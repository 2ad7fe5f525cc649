"""A run's eval.json is never replaced by a narrower evaluation without a word
(meshlm.evaluation.scope)."""
from __future__ import annotations

import json

from meshlm.evaluation.results import EvalResult, Perplexity, write
from meshlm.evaluation.scope import choose, covers, scope_hash, scope_of


def scope(**kw):
    base = dict(data=None, suite="auto", tasks="piqa,arc_easy", shots=[0, 5], limit=None,
                loops=None, exits=[],
                exit_loops=None)
    return scope_of(**{**base, **kw})


def test_what_covers_what():
    full = scope()
    assert (covers(full, full) and covers(full, scope(limit=50))
            and covers(scope(limit=80), scope(limit=50)))
    assert not covers(scope(limit=50), full) and not covers(scope(tasks="piqa"), full)
    assert covers(full, scope(tasks="piqa", shots=[0]))
    assert not covers(full, scope(data="other")) and not covers(scope(loops=[1, 2]), full)
    assert covers(scope(loops=[1, 2, 4], exits=["state:0.1"]), scope(loops=[1, 2]))
    assert scope(tasks="arc_easy,piqa") == full  # the order of a list does not make another scope


def write_eval(run, s, marker):
    """An eval.json of scope `s`, told apart by `marker` (a key the type does not declare: kept)."""
    ppl = Perplexity(loss=1.0, ppl=2.72, tokens=8, sequences=2, data="d", split="val", seq_len=16)
    write(EvalResult(checkpoint=str(run), step=1, model={}, accounting={}, perplexity=ppl, scope=s,
                     complete=True, extra={"marker": marker}), run / "eval.json")


def test_a_narrower_eval_goes_beside_a_wider_one_replaces_and_keeps_the_old(tmp_path):
    full, quick = scope(), scope(limit=50)
    write_eval(tmp_path, full, "full")
    out, note = choose(tmp_path, quick)
    assert out == tmp_path / f"eval-{scope_hash(quick)}.json" and "stays" in note
    assert json.loads((tmp_path / "eval.json").read_text())["marker"] == "full"

    write_eval(tmp_path, quick, "quick")
    out, note = choose(tmp_path, full)
    assert out == tmp_path / "eval.json" and f"eval-{scope_hash(quick)}.json" in note
    assert json.loads((tmp_path
                       / f"eval-{scope_hash(quick)}.json").read_text())["marker"] == "quick"

    write_eval(tmp_path, full, "full")
    assert choose(tmp_path, full) == (tmp_path / "eval.json", None)  # a rerun updates in place


def test_an_older_file_without_a_scope_stays(tmp_path):
    (tmp_path / "eval.json").write_text(json.dumps({"perplexity": {"ppl": 3.0}}))
    out, note = choose(tmp_path, scope())
    assert out.name.startswith("eval-") and "records no scope" in note
    assert choose(tmp_path / "none", scope()) == (tmp_path / "none" / "eval.json", None)
