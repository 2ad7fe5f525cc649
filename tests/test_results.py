"""eval.json and probe.json through their one reader (meshlm.evaluation.results): files of older
meshlm versions come back upgraded, keys a type does not know are kept, and a file that is not a
result is one clear error."""
from __future__ import annotations

import json

import pytest

from meshlm.evaluation.results import (
    EvalResult,
    ProbeResult,
    ResultError,
    read_eval,
    read_probe,
    write,
)

PPL = {"loss": 4.0, "ppl": 54.6, "tokens": 96, "sequences": 6, "data": "data/default",
       "split": "val", "seq_len": 16}


def first_eval_json() -> dict:
    """What the first meshlm wrote (8a2a5e5): no exit rows, no complete flag, no precision, no
    scope, and suites that did not count the tasks their average covers."""
    task = {"acc": 0.5, "acc_norm": 0.6, "metric": "acc_norm", "score": 0.6, "stderr": 0.05,
            "items": 100}
    suite = {"tasks": {"piqa": task, "arc_easy": {**task, "metric": "acc", "score": None}},
             "average": 0.6, "items": 200, "shots": 0, "limit": 100, "seconds": 12.0}
    return {"checkpoint": "runs/mesh/step-000200", "step": 200, "model": {"spec": "1+2R2+1"},
            "accounting": {"non_embedding_params": 1000}, "perplexity": PPL,
            "loops": [{"loops": 1, "trained": False, "loss": 4.5, "ppl": 90.0, "tokens": 96,
                       "sequences": 6}],
            "downstream": {"0": suite}, "seconds": 30.0}


def test_an_eval_json_of_the_first_meshlm_reads_upgraded(tmp_path):
    path = tmp_path / "eval.json"
    path.write_text(json.dumps(first_eval_json()))
    result = read_eval(path)
    assert result.complete is True and result.exit == [] and result.scope is None
    assert result.dtype == "fp32"
    suite = result.downstream["0"]
    assert (suite.covered, suite.of, suite.dtype) == (1, 9, "fp32")  # piqa scored, arc_easy not
    assert suite.tasks["piqa"].score == 0.6 and suite.tasks["arc_easy"].score is None
    assert result.loops[0].loss == 4.5 and result.perplexity.seq_len == 16 and result.step == 200
    assert suite.coverage == "1 of the paper's 9 tasks"
    write(result, path)  # rewritten in today's form, everything it held kept
    again = json.loads(path.read_text())
    suite = {**first_eval_json()["downstream"]["0"], "covered": 1, "of": 9, "dtype": "fp32"}
    assert again == {**first_eval_json(), "complete": True, "exit": [], "dtype": "fp32",
                     "downstream": {"0": suite}}
    assert read_eval(path) == result


def test_a_partial_eval_json_is_not_taken_for_an_old_one(tmp_path):
    """A file written as stages finish records `complete`; a missing precision is not invented."""
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({**first_eval_json(), "complete": False}))
    result = read_eval(path)
    assert result.complete is False and result.dtype is None and result.downstream["0"].dtype == ""


def test_keys_a_type_does_not_declare_are_kept(tmp_path):
    path = tmp_path / "eval.json"
    raw = first_eval_json()
    raw["perplexity"] = {**PPL, "bits_per_byte": 1.25}
    raw["loops"][0]["spread"] = [0.1, 0.2]
    raw["made_by"] = "a newer meshlm"
    path.write_text(json.dumps(raw))
    result = read_eval(path)
    assert result.extra == {"made_by": "a newer meshlm"}
    assert result.perplexity.extra == {"bits_per_byte": 1.25}
    write(result, path)
    again = json.loads(path.read_text())
    assert again["made_by"] == "a newer meshlm" and again["perplexity"]["bits_per_byte"] == 1.25
    assert again["loops"][0]["spread"] == [0.1, 0.2]


def test_files_that_hold_no_result_are_one_clear_error(tmp_path):
    assert read_eval(tmp_path / "none.json") is None and read_probe(tmp_path / "none.json") is None
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({"perplexity": PPL}))
    lacks = r"\(EvalResult lacks 'checkpoint', 'step', 'model', 'accounting'\); re-run"
    with pytest.raises(ResultError, match=r"eval.json is not a meshlm eval result " + lacks):
        read_eval(path)
    path.write_text(json.dumps({**first_eval_json(), "loops": [{"loops": 1}]}))
    with pytest.raises(ResultError, match="DepthRow lacks 'trained', 'loss'"):
        read_eval(path)
    path.write_text('{"checkpoint": ')  # cut short
    with pytest.raises(ResultError, match="is unreadable"):
        read_eval(path)


def test_a_probe_json_without_a_precision_was_probed_in_fp32(tmp_path):
    spread = {"mean": [0.5], "std": [0.0]}
    probe = {"checkpoint": "runs/base/step-000002", "step": 2, "label": "base", "model": {},
             "samples": 2, "tokens": 8, "stages": ["e", "h0", "coda"], "blocks": ["loop 1"],
             "update_core": spread,
             "update_state": spread, "cka_rbf": spread, "cka_linear": spread, "spectrum": spread,
             "effective_rank": spread, "per_sample": {"update_core": [[0.5], [0.5]]}}
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(probe))
    result = read_probe(path)
    assert isinstance(result, ProbeResult) and result.dtype == "fp32" and result.write_usage is None
    assert result.cka("linear").mean == [0.5]
    write(result, path)
    assert json.loads(path.read_text()) == {**probe, "dtype": "fp32"}  # no routing keys invented


def test_a_result_round_trips_through_its_dict():
    raw = {**first_eval_json(), "complete": True, "exit": [], "dtype": "bf16",
           "scope": {"limit": None}}
    raw["downstream"]["0"].update(covered=1, of=9, dtype="bf16")
    assert EvalResult.from_dict(raw).to_dict() == raw
