"""Generative lm-eval tasks (`generate_until`) through meshlm's cached decoding: a local task YAML,
run by `meshlm eval --tasks FILE.yaml` and by lm-eval's own HF model on the export, give the same
text item for item at the same precision; speculation and stop strings behave as lm-eval's HFLM."""
from __future__ import annotations

import json

import pytest
import yaml
from conftest import build, tiny
from evalkit import tiny_checkpoint

from meshlm.cli import main
from meshlm.data.tokenizer import load_tokenizer
from meshlm.generate import Sampling, generate
from meshlm.generate.speculative import Speculation
from meshlm.model.exit import ExitRule

STOP = ["e", "\n\n"]  # "e" comes up in a few tokens of any text: the cut is exercised on every item


def task_yaml(folder, n_docs=5):
    """A generative task of `n_docs` prompts of different lengths, in lm-eval's own YAML format."""
    docs = [{"question": "To be, or not to be" + ", that is the question" * i, "answer": "x"}
            for i in range(n_docs)]
    data = folder / "tiny_gen.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    spec = {"task": "tiny_gen", "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "output_type": "generate_until", "doc_to_text": "{{question}}",
            "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": STOP, "max_gen_toks": 10, "do_sample": False},
            "metric_list": [{"metric": "exact_match"}]}
    path = folder / "tiny_gen.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def requests(contexts, gen_kwargs):
    from lm_eval.api.instance import Instance

    return [Instance(request_type="generate_until", doc={}, arguments=(c, dict(gen_kwargs)), idx=0)
            for c in contexts]


def test_generate_until_is_greedy_decoding_cut_at_the_first_stop_and_speculation_changes_nothing():
    from meshlm.evaluation.harness import MeshLMEval

    model, tok = build(tiny(spec="1+2R3+1", vocab_size=8192)), load_tokenizer("default")
    contexts = ["Once upon a time",
                "To be, or not to be, that is the question: whether 'tis nobler", "Hi"]
    settings = {"until": STOP, "max_gen_toks": 12, "do_sample": False}
    # 2 batches
    texts = MeshLMEval(model, tok, batch_tokens=40).generate_until(requests(contexts, settings))
    for context, text in zip(contexts, texts):
        made = generate(model, [tok.encode(context)], Sampling(max_new_tokens=12, temperature=0),
                        tok.eos_id,
                        tok.pad_id)[0]
        full = tok.hf.decode([t for t in made if t not in (tok.eos_id, tok.pad_id)],
                             skip_special_tokens=True)
        # the text before the first stop string
        assert text == min((full.split(s)[0] for s in STOP), key=len)
    assert any(len(t) < 12 for t in texts)
    fast = MeshLMEval(model, tok, speculate=Speculation(1, 3)).generate_until(
        requests(contexts, settings))
    assert fast == texts
    deeper = MeshLMEval(model, tok, loops=1,
                        exit=ExitRule.parse("state:inf")).generate_until(
        requests(contexts, settings))
    assert len(deeper) == 3 and all(isinstance(t, str) for t in deeper)


@pytest.mark.slow  # lm-eval's HF model and meshlm eval on the same tiny task: ~30 s
def test_meshlm_eval_of_a_generative_yaml_task_equals_lm_eval_hf_on_the_export(tmp_path, prepared):
    import lm_eval
    from lm_eval.tasks._yaml_loader import load_yaml

    run = tiny_checkpoint(tmp_path, "mesh", prepared)
    assert main(["convert", str(run), str(tmp_path / "hf"), "--to", "hf"]) == 0
    task = task_yaml(tmp_path)
    out = tmp_path / "eval.json"
    assert (main(["eval", str(run), "--tasks", str(task), "--shots", "0", "--loops", "none",
                  "--limit", "2",
                  "--dtype", "fp32", "--log-samples", "--out", str(out)]) == 0)
    ours = json.loads(out.read_text())["downstream"]["0"]["tasks"]["tiny_gen"]
    assert ours["external"] and ours["output_type"] == "generate_until" and ours["items"] == 2
    samples = [json.loads(line) for line in (tmp_path / "eval-samples"
                                             / "0-shot.jsonl").read_text().splitlines()]
    raw = lm_eval.simple_evaluate(model="hf",
                                  model_args=f"pretrained={tmp_path / 'hf'},dtype=float32",
                                  tasks=[load_yaml(task)], limit=2, log_samples=True, batch_size=2,
                                  device="cpu")
    theirs = {s["doc_id"]: s["resps"] for s in raw["samples"]["tiny_gen"]}
    assert {s["doc_id"]: s["resps"] for s in samples} == theirs and len(theirs) == 2
    assert ours["score"] == raw["results"]["tiny_gen"]["exact_match,none"]


def test_scoring_and_generation_report_progress_so_a_long_setting_is_not_silent():
    from meshlm.evaluation.harness import MeshLMEval

    model, tok = build(tiny(spec="1+2R2+1", vocab_size=8192)), load_tokenizer("default")
    lines = []
    lm = MeshLMEval(model, tok, batch_tokens=64, log=lines.append, every_s=0.0)
    from lm_eval.api.instance import Instance

    pairs = [Instance(request_type="loglikelihood", doc={},
                      arguments=(f"Once upon a time {i}", " there"), idx=0)
             for i in range(5)]
    lm.loglikelihood(pairs)
    lm.generate_until(requests(["Hi", "Hello there"],
                               {"until": STOP, "max_gen_toks": 3, "do_sample": False}))
    assert any("of 5 loglikelihood requests" in line for line in lines)
    assert any(line.strip().startswith("5 loglikelihood requests in") for line in lines)
    assert any(line.strip().startswith("2 generate_until requests in") for line in lines)


def test_a_task_whose_hub_data_are_not_cached_is_one_clear_error(tmp_path):
    import meshlm.evaluation  # noqa: F401  (switches the Hub off for lm-eval's datasets, as meshlm eval runs)
    from meshlm.errors import DataError
    from meshlm.evaluation.downstream import run_suite
    from meshlm.evaluation.harness import MeshLMEval

    path = task_yaml(tmp_path)
    spec = yaml.safe_load(path.read_text())
    spec.update(dataset_path="acme/not-in-the-cache", dataset_kwargs=None)
    path.write_text(yaml.safe_dump(spec))
    lm = MeshLMEval(build(tiny(spec="1+2R2+1", vocab_size=8192)), load_tokenizer("default"))
    with pytest.raises(DataError, match=r"keeps the Hugging Face Hub off, so a task's Hub data "
                                        r"must be in the local"):
        run_suite(lm, [str(path)], limit=1)


@pytest.mark.slow  # lm-eval's HF model and meshlm eval on the shipped task: ~30 s
def test_the_shipped_generative_task_runs_offline_with_lm_evals_own_numbers(tmp_path, prepared):
    """meshlm_recite (meshlm.evaluation.tasks.recite): `meshlm eval --tasks meshlm_recite` and
    lm-eval's HF model on the export, with lm-eval pointed at meshlm's shipped task folder, decode
    the same text per item."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from meshlm.evaluation.tasks import recite

    run = tiny_checkpoint(tmp_path, "mesh", prepared)
    assert main(["convert", str(run), str(tmp_path / "hf"), "--to", "hf"]) == 0
    out = tmp_path / "eval.json"
    assert (main(["eval", str(run), "--tasks", "meshlm_recite", "--shots", "0", "--loops", "none",
                  "--limit", "3",
                  "--dtype", "fp32", "--log-samples", "--out", str(out)]) == 0)
    ours = json.loads(out.read_text())["downstream"]["0"]["tasks"]["meshlm_recite"]
    assert ours["items"] == 3 and ours["metric"] == "exact_match"
    samples = [json.loads(line) for line in (tmp_path / "eval-samples"
                                             / "0-shot.jsonl").read_text().splitlines()]
    manager = TaskManager(include_defaults=False, include_path=str(recite.FOLDER))
    raw = lm_eval.simple_evaluate(model="hf",
                                  model_args=f"pretrained={tmp_path / 'hf'},dtype=float32",
                                  tasks=["meshlm_recite"], task_manager=manager, limit=3,
                                  log_samples=True,
                                  batch_size=3, device="cpu")
    theirs = {s["doc_id"]: s["resps"] for s in raw["samples"]["meshlm_recite"]}
    assert {s["doc_id"]: s["resps"] for s in samples} == theirs and len(theirs) == 3
    assert ours["score"] == raw["results"]["meshlm_recite"]["exact_match,none"]
