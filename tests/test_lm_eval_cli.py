"""lm-eval's own CLI on meshlm's exported tasks and a Hugging Face export: offline, and the same
numbers as `meshlm eval` (every task, 5-shot, two items each)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from evalkit import fake_lambada_standard_cache, tiny_checkpoint, wheel_cache
from trainkit import ROOT

from meshlm.cli import main
from meshlm.evaluation.tasks import SUITE, resolve_tasks
from meshlm.evaluation.tasks.export import PREFIX, export_tasks, exported_name


def test_exported_yamls_hold_lm_evals_own_and_point_at_absolute_copies(tmp_path):
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager, get_task_dict

    cache = wheel_cache(tmp_path / "cache")
    names = export_tasks(tmp_path / "tasks", resolve_tasks("piqa,hellaswag,mmlu"), cache)
    assert names == ["meshlm_piqa", "meshlm_hellaswag", "meshlm_mmlu"]
    piqa = yaml.safe_load((tmp_path / "tasks" / "meshlm_piqa.yaml").read_text())
    assert ("include" not in piqa and piqa["doc_to_choice"]
            and piqa["output_type"] == "multiple_choice")
    # inside this venv: never named
    lm_eval_dir = str(Path(lm_eval.tasks.__file__).resolve().parent)
    assert not any(lm_eval_dir in p.read_text() for p in (tmp_path / "tasks").glob("*.yaml"))
    hellaswag = (tmp_path / "tasks" / "meshlm_hellaswag.yaml").read_text()
    assert re.search(r"process_docs: !function '?lm_eval\.tasks\.hellaswag\.utils\.process_docs",
                     hellaswag)
    task = get_task_dict(["meshlm_hellaswag"], TaskManager(include_defaults=False,
                                                           include_path=str(
                                                               tmp_path
                                                               / "tasks")))["meshlm_hellaswag"]
    assert callable(task.config.process_docs) and len(task.eval_docs) == 10042
    data = piqa["dataset_kwargs"]["data_files"]["validation"]
    assert os.path.isabs(data) and Path(data).is_relative_to(tmp_path / "tasks" / "data")
    assert Path(data).read_bytes() == (cache
                                       / "evals").glob(
                                           "*/piqa/validation.jsonl").__next__().read_bytes()
    group = yaml.safe_load((tmp_path / "tasks" / "meshlm_mmlu.yaml").read_text())
    assert len(group["task"]) == 57 and group["aggregate_metric_list"][0]["weight_by_size"]
    assert exported_name("mmlu_anatomy_continuation") == "meshlm_mmlu_anatomy"
    suite = yaml.safe_load((tmp_path / "tasks" / "meshlm_suite.yaml").read_text())
    assert suite["task"] == names


def test_tasks_export_replaces_only_its_own_earlier_export(tmp_path, capsys):
    cache = wheel_cache(tmp_path / "cache")
    args = ["tasks", "export", str(tmp_path / "tasks"), "--tasks", "piqa", "--cache-dir",
            str(cache)]
    assert main(args) == 0
    assert main(args) == 2 and "pass --overwrite" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 0
    assert (tmp_path / "tasks" / "meshlm_piqa.yaml").is_file()


def _loglikelihoods(records: list[dict], task_of) -> dict[tuple[str, int], list[float]]:
    """(task, doc_id) -> each request's loglikelihood, from lm-eval sample records."""
    out = {}
    for r in records:
        out[(task_of(r), r["doc_id"])] = [float(resp[0][0]) for resp in r["resps"]]
    return out


@pytest.mark.slow
def test_lm_eval_cli_runs_the_exported_tasks_offline_with_meshlm_evals_numbers(tmp_path, prepared):
    cache = wheel_cache(tmp_path / "cache")
    run = tiny_checkpoint(tmp_path, "mesh", prepared)
    assert main(["convert", str(run), str(tmp_path / "hf"), "--to", "hf"]) == 0
    with pytest.MonkeyPatch.context() as patch:
        import datasets

        patch.setattr(datasets.config, "HF_DATASETS_CACHE",
                      fake_lambada_standard_cache(tmp_path / "hf-datasets"))
        assert main(["tasks", "export", str(tmp_path / "tasks"), "--cache-dir", str(cache)]) == 0
    no_net = ["unshare", "--net"] if shutil.which("unshare") and os.geteuid() == 0 else []
    # LAMBADA-standard comes from the HF datasets cache (here a stand-in): both routes score all
    # nine tasks
    hf_datasets = tmp_path / "hf-datasets"
    env = {**os.environ, "MESHLM_CACHE": str(cache), "HF_DATASETS_CACHE": str(hf_datasets),
           "HF_HOME": str(tmp_path / "hf-home"), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    ours = subprocess.run([*no_net, sys.executable, "-m", "meshlm.cli", "eval", str(run), "--limit",
                           "2",
                           "--shots", "5", "--loops", "none", "--log-samples",
                           "--dtype", "fp32"],  # lm_eval --model hf computes in fp32
                          capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(ROOT / "src")}, timeout=900)
    assert ours.returncode == 0, ours.stderr[-3000:]
    # a process that never sees meshlm's sources: the export and the YAMLs suffice
    theirs = subprocess.run(
        [*no_net, sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
         f"pretrained={tmp_path / 'hf'},trust_remote_code=True", "--include_path",
         str(tmp_path / "tasks"),
         "--tasks", "meshlm_suite", "--limit", "2", "--num_fewshot", "5", "--seed", "1234",
         "--device", "cpu",
         "--output_path", str(tmp_path / "lm-eval-out"), "--log_samples"],
        capture_output=True, text=True, env={**env, "PYTHONPATH": ""}, cwd=tmp_path, timeout=900)
    assert theirs.returncode == 0, theirs.stderr[-3000:]
    [results_file] = (tmp_path / "lm-eval-out").rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    summary = json.loads((run / "eval.json").read_text())["downstream"]["5"]
    suite = summary["tasks"]
    assert list(suite) == list(SUITE) and (summary["covered"], summary["of"]) == (9, 9)
    for name in SUITE:
        got = results[PREFIX + name]
        for metric in ("acc", "acc_norm"):
            if suite[name][metric] is not None:
                assert got[f"{metric},none"] == pytest.approx(suite[name][metric]), (name, metric)
    # item by item: the same requests, the same loglikelihoods (HF export + HFLM vs. MeshLM +
    # meshlm's adapter)
    mine = [json.loads(line) for line in (run / "eval-samples"
                                          / "5-shot.jsonl").read_text().splitlines()]
    expected = _loglikelihoods(mine, lambda r: exported_name(r["task"]))
    got: dict = {}
    for path in (tmp_path / "lm-eval-out").rglob("samples_*.jsonl"):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        records = [json.loads(line) for line in path.read_text().splitlines()]
        got.update(_loglikelihoods(records, lambda r, task=task: task))
    assert set(got) == set(expected) and len(got) == 2 * (len(SUITE) - 1 + 57)
    for key, values in expected.items():
        assert got[key] == pytest.approx(values, abs=1e-4), key
