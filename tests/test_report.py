"""`meshlm report` renders every section for two tiny runs, self-contained; probe figures are PNGs."""
from __future__ import annotations

import json
import re

import pytest
import torch
from evalkit import tiny_checkpoint
from trainkit import make_prepared

from meshlm.analysis import plots
from meshlm.analysis.probes import probe
from meshlm.analysis.report import collect, notes, table_one
from meshlm.cli import main
from meshlm.errors import MeshlmError
from meshlm.evaluation.loaded import open_checkpoint
from meshlm.evaluation.run import EvalOptions, evaluate, write_json
from meshlm.evaluation.tasks import SUITE


def fake_suite(shots: int, offset: float) -> dict:
    """A downstream summary in run_suite's format (the real one needs lm-eval; see test_evaluate)."""
    tasks = {name: {"acc": 0.3 + offset, "acc_norm": 0.35 + offset, "metric": task.metric,
                    "score": 0.3 + offset, "stderr": 0.01, "items": 10} for name, task in SUITE.items()}
    return {"tasks": tasks, "average": 0.3 + offset, "items": 80, "shots": shots, "limit": 10, "seconds": 1.0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two tiny runs (mesh, base), each with a real eval.json (no tasks) + fake suite and a real probe."""
    root = tmp_path_factory.mktemp("runs")
    prepared = make_prepared(tmp_path_factory)
    out = []
    for i, scheme in enumerate(("mesh", "base")):
        loaded = open_checkpoint(tiny_checkpoint(root, scheme, prepared, seed=i))
        options = EvalOptions(tasks=None, limit=2, exits=["state:0", "state:inf", "kl:0.01"])
        result = evaluate(loaded, options, log=lambda message: None)
        result["downstream"] = {"0": fake_suite(0, 0.01 * i), "5": fake_suite(5, 0.02 * i)}
        write_json(result, loaded.run_dir / "eval.json")
        samples = torch.randint(0, 8192, (3, 16))
        write_json({"model": loaded.model.config.to_dict(), **probe(loaded.model, samples)},
                   loaded.run_dir / "probe" / "probe.json")
        out.append(loaded.run_dir)
    return out


def test_report_renders_every_section_for_two_runs(runs, tmp_path):
    out = tmp_path / "report.html"
    assert main(["report", *map(str, runs), "--out", str(out), "--title", "two tiny runs",
                 "--figures", str(tmp_path / "figures")]) == 0
    page = out.read_text()
    for section in ("id='table'", "id='loops'", "id='exit'", "id='probes'", "id='notes'", "<h3>0-shot</h3>",
                    "<h3>5-shot</h3>"):
        assert section in page
    for name in ("tiny-mesh", "tiny-base", "1+2R2+1", "PIQA", "MMLU", "acc_norm", "val PPL", "non-emb. params"):
        assert name in page
    # two Table-1s and the loops table: header + two runs each; the exit table: header + 2 runs x 3 rules
    assert page.count("<tr>") == 2 * 3 + 3 + 7 and "state:inf" in page and "avg loops/token" in page
    images = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert len(images) == 2 + 6  # loss vs loops, exit frontier + updates, cka, cka_steps, spectrum, rank, router
    assert not re.search(r"(src|href)=['\"](http|file|/)", page)  # self-contained
    assert "--limit 10" in page  # the fake suites were "limited": the note says so
    saved = sorted(p.name for p in (tmp_path / "figures").iterdir())
    names = ("loops", "exit", "updates", "cka", "cka_steps", "spectrum", "rank", "router")
    assert saved == sorted(f"{n}.png" for n in names)


def test_report_collects_from_a_checkpoint_path_and_explains_missing_results(runs, tmp_path):
    (runs[1] / "eval.json").rename(tmp_path / "moved.json")
    try:
        results = [collect(runs[0] / "step-000001"), collect(runs[1])]
        assert results[0].name == "tiny-mesh" and results[1].eval is None and results[1].model["scheme"] == "base"
        assert f"meshlm eval {runs[1]}" in notes(results)
        table = table_one(results, "0")
        assert table.count("<td>—</td>") == 1 + len(SUITE) + 1  # base: no PPL, no task scores, no average
    finally:
        (tmp_path / "moved.json").rename(runs[1] / "eval.json")
    with pytest.raises(MeshlmError, match="meshlm eval"):
        collect(tmp_path)


def test_probe_figures_are_pngs(runs):
    results = [(r.name, json.loads((r / "probe" / "probe.json").read_text())) for r in runs]
    figures = plots.probe_figures(results)
    assert set(figures) == {"updates", "cka", "cka_steps", "spectrum", "rank", "router"}
    assert plots.png_bytes(figures["router"]).startswith(b"\x89PNG")
    assert "router" not in plots.probe_figures(results[1:])  # base has no routers
