"""`meshlm reproduce`: study files, the plan with estimates, and a tiny study end to end
(resumable)."""
import json
from pathlib import Path

import pytest
import torch
import yaml

from meshlm.analysis.results_page import paired_markdown, probe_row, read_runs, results_markdown
from meshlm.analysis.study import load_study, plan_table
from meshlm.cli import main
from meshlm.errors import ConfigError
from meshlm.evaluation.results import EvalResult, Perplexity, ProbeResult, write
from meshlm.train.config import SHIPPED_CONFIGS

STUDIES = SHIPPED_CONFIGS / "studies"
TINY = ["model.preset=mesh-small", "model.d_model=32", "model.n_heads=4", "model.context_length=32",
        "train.seq_len=32", "train.global_batch=2", "train.micro_batch=2", "train.steps=2",
        "train.eval_every=0", "train.eval_windows=2", "train.save_every=0"]


def write_study(tmp_path, **fields) -> Path:
    study = {"name": "t", "out_dir": str(tmp_path / "runs"), "overrides": TINY, "seeds": [0],
             "variants": {"base": {"overrides": ["model.spec=1+1R2+1", "model.scheme=base"]},
                          "mesh": {"overrides": ["model.spec=1+1R2+1", "model.scheme=mesh"]}},
             "eval": ["--tasks", "none", "--limit", "2", "--loops", "1,2"],
             "probe": ["--samples", "2", "--tokens", "16"], **fields}
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(study))
    return path


@pytest.mark.parametrize("path", sorted(STUDIES.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_studies_parse_and_estimate(path):
    study = load_study(path)
    assert study.runs
    table = plan_table(study)
    assert "GPU-hours in all" in table and all(run.name in table for run in study.runs)


def test_plans_give_durations_in_units_that_show_them_at_this_machines_peak():
    from meshlm.analysis.study import duration, planning_peak
    from meshlm.runtime.peaks import device_peak
    from meshlm.runtime.precision import choose

    assert (duration(2.54), duration(0.5), duration(40 / 3600)) == ("2.5 h", "30 min", "40 s")
    quick = load_study(STUDIES / "quick.yaml")  # no peak_flops: this machine's device
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert planning_peak(quick) == device_peak(device, choose("auto", device).dtype)
    table = plan_table(quick)
    # not "wall h 0.0": minutes or seconds where runs are short
    assert "0.0" not in table.split("\n")[2]
    assert device.type != "cpu" or " min" in table
    paper = load_study(STUDIES / "paper-160m.yaml")
    assert planning_peak(paper) == (989e12, "the study's peak_flops")


def test_runs_are_variants_times_seeds(tmp_path):
    study = load_study(write_study(tmp_path, seeds=[0, 1], variants={
        "a": {"overrides": ["model.scheme=base"]},
        "b": {"overrides": ["model.scheme=mesh"], "seeds": [5]}}))
    assert [r.name for r in study.runs] == ["a-s0", "a-s1", "b-s5"]
    assert "train.seed=5" in study.runs[-1].overrides


def test_only_and_seeds_pick_part_of_a_study(tmp_path):
    path = write_study(tmp_path, seeds=[0, 1], variants={
        "chase-a": {"overrides": ["model.scheme=base"]},
        "chase-b": {"overrides": ["model.scheme=mesh"], "seeds": [5]},
        "dag-a": {"overrides": ["model.scheme=base"]}})
    assert [r.name for r in load_study(path, only="chase-*").runs] == ["chase-a-s0", "chase-a-s1",
                                                                       "chase-b-s5"]
    assert ([r.name for r in load_study(path, only="dag-a,chase-b", seeds=[3]).runs]
            == ["chase-b-s3", "dag-a-s3"])
    with pytest.raises(ConfigError, match="--only 'mod\\*' matches no variant"):
        load_study(path, only="mod*")


def test_a_later_stage_starts_from_its_sources_run_of_the_same_seed(tmp_path):
    path = write_study(tmp_path, seeds=[0, 1], variants={
        "a": {"overrides": ["model.scheme=base"]},
        "b": {"from": "a", "overrides": ["model.scheme=anchor", "train.steps=3"]},
        "c": {"from": "b", "overrides": ["train.steps=4"], "seeds": [1]}})
    study = load_study(path, only="c")  # its sources are planned too, before it
    assert [r.name for r in study.runs] == ["a-s1", "b-s1", "c-s1"]
    a, b, c = study.runs
    assert (c.source, b.source, a.source) == (b, a, None)
    assert f"train.init_from={a.dir}" in b.overrides and f"train.init_from={b.dir}" in c.overrides
    # the model is its source's: only the stage's own model.* overrides apply
    assert [o for o in b.overrides if o.startswith("model.")] == ["model.scheme=anchor"]
    assert "model.preset=mesh-small" in a.overrides
    assert all(name in plan_table(study) for name in ("a-s1", "b-s1", "c-s1"))  # nothing trained


@pytest.mark.parametrize("fields, message", [
    ({"variants": {"a": {"from": "z"}}}, "`from: z` names no variant of this study"),
    ({"variants": {"a": {"from": "b"}, "b": {"from": "a"}}},
     "goes round in a circle \\(a -> b -> a\\)"),
    ({"variants": {"a": {"overides": []}}}, "variant a: unknown key 'overides'"),
    ({"variants": {}}, "at least one variant"),
    ({"seeds": "zero"}, "`seeds` must be a non-empty list"),
    ({"colour": 1}, "unknown key 'colour'"),
    ({"variants": {"x": {"overrides": ["model.spec=4+8R0+4"]}}}, "8R0"),
])
def test_bad_studies_are_one_clear_error(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        load_study(write_study(tmp_path, **fields))


def test_missing_study_file_exits_2(tmp_path, capsys):
    assert main(["reproduce", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("jobs", [1, 2])
def test_tiny_study_end_to_end_and_rerun_skips(tmp_path, capsys, jobs):
    path = write_study(tmp_path)
    assert main(["reproduce", str(path), "--jobs", str(jobs)]) == 0
    out_dir = tmp_path / "runs" / "t"
    for run in ["base-s0", "mesh-s0"]:
        assert ((out_dir / run / "eval.json").is_file()
                and (out_dir / run / "probe" / "probe.json").is_file())
    results = (out_dir / "results.md").read_text()
    assert "| base | `1+1R2+1` | base |" in results and "| mesh | `1+1R2+1` | mesh |" in results
    assert "| variant | K' = 1 | K' = 2 |" in results  # loss vs. loop count, from eval.json
    probes = results[results.index("Probes of the loop states"):]
    assert "| base | 1 |" in probes and "| mesh | 1 |" in probes and " → " in probes  # t = 1 → 2
    assert (out_dir / "report.html").read_text().count("<table") >= 1
    capsys.readouterr()
    assert main(["reproduce", str(path)]) == 0  # everything finished: nothing is trained again
    assert capsys.readouterr().out.count("done, skipped") == 2
    assert results_markdown(load_study(path)) == results


def test_a_later_stage_trains_after_its_source_from_its_weights(tmp_path, capsys):
    path = write_study(tmp_path, variants={
        "base": {"overrides": ["model.spec=1+1R2+1", "model.scheme=base"]},
        "more": {"from": "base", "overrides": ["train.steps=3"]}})
    assert main(["reproduce", str(path), "--only", "more", "--jobs", "2"]) == 0
    out_dir = tmp_path / "runs" / "t"
    log = (out_dir / "more-s0" / "train.log").read_text()
    assert f"initialised from {out_dir / 'base-s0'}" in log
    records = {r.run.name: r for r in read_runs(load_study(path))}
    own = json.loads((out_dir / "more-s0" / "study.json").read_text())["train_seconds"]
    assert records["more-s0"].train_seconds == pytest.approx(own + records["base-s0"].train_seconds)


def probe_result() -> ProbeResult:
    """A probe of a 1+2R2+1 model (stages e, h0, h1, h2, coda), as probe.json holds it."""
    cka = [[1.0, 0.5, 0.4, 0.3, 0.2], [0.5, 1.0, 0.9, 0.6, 0.5], [0.4, 0.9, 1.0, 0.8, 0.7],
           [0.3, 0.6, 0.8, 1.0, 0.95], [0.2, 0.5, 0.7, 0.95, 1.0]]
    def spread(mean):
        return {"mean": mean, "std": torch.zeros(torch.tensor(mean).shape).tolist()}

    return ProbeResult.from_dict({
        "samples": 2, "tokens": 16, "stages": ["e", "h0", "h1", "h2", "coda"],
        "blocks": ["prelude", "loop 1", "loop 2", "coda"],
        "update_core": spread([1.7, 1.4, 1.0, 0.3]), "update_state": spread([1.7, 1.4, 1.0, 0.3]),
        "cka_rbf": spread(cka), "cka_linear": spread(cka), "spectrum": spread([[1.0, 0.5]] * 5),
        "effective_rank": spread([100.0, 60.0, 50.0, 45.0, 55.0])})


def eval_result(loss: float, scheme: str = "base") -> EvalResult:
    ppl = Perplexity(loss=loss, ppl=2.0 ** loss, tokens=8, sequences=2, data="d", split="val",
                     seq_len=16)
    return EvalResult(checkpoint="c", step=2, model={"spec": "1+1R2+1", "scheme": scheme},
                      accounting={"non_embedding_params": 1000}, perplexity=ppl, complete=True)


def test_probe_summary_reads_loop_steps_from_probe_json():
    row = probe_row(probe_result())
    assert row == {"update": [1.4, 1.0], "cka": [0.9, 0.8], "rank": [50.0, 45.0]}


def test_paired_differences_by_seed(tmp_path):
    study = load_study(write_study(tmp_path, seeds=[0, 1]))
    for run, loss in zip(study.runs, [5.0, 5.2, 4.9, 5.3]):  # base-s0, base-s1, mesh-s0, mesh-s1
        write(eval_result(loss), run.dir / "eval.json")
    row = [line for line in paired_markdown(read_runs(study)) if line.startswith("| base − mesh")]
    assert row == ["| base − mesh | 2 | 0.000 ± 0.141 | +0.100, -0.100 | 1/2 |"]


def test_the_results_page_reads_each_runs_results_once(tmp_path, monkeypatch):
    from pathlib import Path

    study = load_study(write_study(tmp_path, seeds=[0, 1]))
    for run, loss in zip(study.runs, [5.0, 5.2, 4.9, 5.3]):
        write(eval_result(loss, run.variant), run.dir / "eval.json")
        write(probe_result(), run.dir / "probe" / "probe.json")
    reads: dict[str, int] = {}
    read_text = Path.read_text

    def counted(path, *args, **kwargs):
        reads[path.name] = reads.get(path.name, 0) + 1
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counted)
    page = results_markdown(study)
    assert reads == {"eval.json": 4, "probe.json": 4}  # four runs, one read of each file
    assert "| base − mesh | 2 |" in page and "| mesh | 2 | 1.40 ± 0.00 → 1.00 ± 0.00 |" in page


@pytest.mark.parametrize("keep_going", [False, True])
def test_a_failed_run_stops_the_study_unless_keep_going(tmp_path, capsys, keep_going):
    broken = ["model.spec=1+1R2+1", f"train.data={tmp_path}/nope"]
    path = write_study(tmp_path, variants={"broken": {"overrides": broken},
                                           "mesh": {"overrides": ["model.spec=1+1R2+1",
                                                                  "model.scheme=mesh"]}})
    assert main(["reproduce", str(path), *(["--keep-going"] if keep_going else [])]) == 1
    err = capsys.readouterr().err
    assert "train of broken-s0 failed" in err and "broken-s0/train.log" in err
    assert (tmp_path / "runs" / "t" / "mesh-s0" / "eval.json").is_file() == keep_going
    assert (tmp_path / "runs" / "t" / "results.md").is_file()  # the page shows what finished


def test_jobs_below_one_is_refused(tmp_path, capsys):
    assert main(["reproduce", str(write_study(tmp_path)), "--jobs", "0"]) == 2
    assert "--jobs 0" in capsys.readouterr().err


def test_a_job_slot_gets_its_share_of_the_cores(monkeypatch):
    from meshlm.analysis.study_runner import job_environment

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert job_environment(0, 4, launcher=False)["OMP_NUM_THREADS"] == "4"
    assert job_environment(0, 32, launcher=False)["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's setting wins
    assert "OMP_NUM_THREADS" not in job_environment(0, 4, launcher=False)


# enough that no run finishes while another one, started at the same time on a loaded machine (the
# test suite's other worker), has yet to log its third step: a tiny step takes ~10 ms
STEPS = 600


@pytest.mark.slow
def test_ctrl_c_stops_the_study_with_the_running_training_saved_and_a_rerun_finishes(tmp_path):
    """SIGINT to `meshlm reproduce` reaches every running training once: each saves its step; the
    study exits 130 and says to run it again, which resumes those runs and finishes the study.
    Two at a time (--jobs 2): the one-at-a-time study runs the same worker and signal
    forwarding with one slot (study_runner.execute)."""
    jobs = 2
    import json
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    overrides = [o for o in TINY if not o.startswith("train.steps")] + [f"train.steps={STEPS}"]
    variants = {"base": {"overrides": ["model.spec=1+1R2+1", "model.scheme=base"]},
                "mesh": {"overrides": ["model.spec=1+1R2+1", "model.scheme=mesh"]}}
    path = write_study(tmp_path, overrides=overrides, variants=dict(list(variants.items())[:jobs]))
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1",
           "MESHLM_DEBUG": ""}
    command = [sys.executable, "-m", "meshlm.cli", "reproduce", str(path), "--jobs", str(jobs)]
    proc = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            text=True)
    runs = [tmp_path / "runs" / "t" / f"{name}-s0" for name in list(variants)[:jobs]]
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if all((run / "metrics.jsonl").is_file()
               and (run / "metrics.jsonl").read_text().count('"kind": "train"') >= 3
               for run in runs):
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert re.match(r"meshlm reproduce: stopped: train of (base|mesh)-s0 stopped \(its current "
                    r"step is saved\)",
                    last), last
    assert "Traceback" not in err
    for run in runs:  # every running training got the signal once and saved its step
        steps = [json.loads(line)["step"]
                 for line in (run / "metrics.jsonl").read_text().splitlines()
                 if '"train"' in line]
        assert 3 <= max(steps) < STEPS and list(run.glob("step-*")), run.name

    again = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stderr
    assert all("resumed" in (run / "train.log").read_text() for run in runs)
    assert (tmp_path / "runs" / "t" / "results.md").is_file()
