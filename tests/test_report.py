"""`meshlm report` renders every section for two tiny runs, self-contained; probe figures are
PNGs."""
from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from evalkit import tiny_checkpoint
from trainkit import make_prepared

from meshlm import outputs
from meshlm.analysis import plots
from meshlm.analysis.probes import probe
from meshlm.analysis.report import collect, notes, table_one
from meshlm.cli import main
from meshlm.errors import MeshlmError
from meshlm.evaluation.results import ProbeResult, Suite, read_eval, read_probe, write
from meshlm.evaluation.run import EvalOptions, evaluate
from meshlm.evaluation.tasks import SUITE
from meshlm.loading import open_model
from meshlm.model.exit import ExitRule


def fake_suite(shots: int, offset: float) -> dict:
    """A downstream summary in run_suite's format (the real one needs lm-eval; see
    test_evaluate)."""
    tasks = {name: {"acc": 0.3 + offset, "acc_norm": 0.35 + offset, "metric": task.metric,
                    "score": 0.3 + offset, "stderr": 0.01, "items": 10}
             for name, task in SUITE.items()}
    return Suite.from_dict({"tasks": tasks, "average": 0.3 + offset, "covered": len(tasks), "of": 9,
                            "items": 80, "shots": shots, "limit": 10, "seconds": 1.0})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two tiny runs (mesh, base), each with a real eval.json (no tasks) + fake suite and a real
    probe."""
    root = tmp_path_factory.mktemp("runs")
    prepared = make_prepared(tmp_path_factory)
    out = []
    for i, scheme in enumerate(("mesh", "base")):
        loaded = open_model(tiny_checkpoint(root, scheme, prepared, seed=i))
        options = EvalOptions(tasks=None, limit=2, exits=[ExitRule.parse(r) for r in
                                                          ("state:0", "state:inf", "kl:0.01")])
        result = evaluate(loaded, options, log=lambda message: None)
        result.downstream = {"0": fake_suite(0, 0.01 * i), "5": fake_suite(5, 0.02 * i)}
        write(result, loaded.run_dir / "eval.json")
        samples = torch.randint(0, 8192, (3, 16))
        probed = {"model": loaded.model.config.to_dict(), "dtype": "fp32",
                  **probe(loaded.model, samples)}
        write(ProbeResult.from_dict(probed), loaded.run_dir / "probe" / "probe.json")
        write_metrics(loaded.run_dir, offset=0.1 * i)
        out.append(loaded.run_dir)
    return out


def write_metrics(run_dir, offset: float = 0.0, steps: int = 20,
                  tokens_per_step: int = 512) -> None:
    """metrics.jsonl as the trainer writes it; the first validation record lacks `tokens` like older
    runs'."""
    lines = []
    for step in range(1, steps + 1):
        lines.append({"kind": "train", "step": step, "loss": 6.0 - 0.1 * step + offset, "lr": 1e-3,
                      "tokens": step * tokens_per_step})
        if step % 10 == 0:
            record = {"kind": "eval", "step": step, "val_loss": 6.1 - 0.1 * step + offset}
            lines.append(record if step == 10 else {**record, "tokens": step * tokens_per_step})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines)
                                           + '{"kind": "tr')


@pytest.mark.slow
def test_report_figures_replace_only_an_earlier_reports_with_overwrite(runs, tmp_path, capsys):
    args = ["report", *map(str, runs), "--out", str(tmp_path / "r.html"), "--figures",
            str(tmp_path / "figures")]
    assert main(args) == 0
    assert main(args) == 2 and "pass --overwrite" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 0
    assert outputs.made_by(tmp_path / "figures") == "report"


def test_report_renders_every_section_for_two_runs(runs, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["report", *map(str, runs), "--out", str(out), "--title", "two tiny runs",
                 "--figures", str(tmp_path / "figures")]) == 0
    printed = capsys.readouterr()
    assert printed.out.startswith("report: ") and ("meshlm report: note: tiny-mesh: tasks scored "
                                                   "with --limit 10") \
        in printed.err  # what the notes say goes to stderr too, the result alone to stdout
    page = out.read_text()
    for section in ("id='table'", "id='training'", "id='loops'", "id='exit'", "id='probes'",
                    "id='notes'",
                    "<h3>0-shot</h3>", "<h3>5-shot</h3>",
                    f"avg<br><small>{len(SUITE)} of 9 tasks</small>"):
        assert section in page
    for name in ("tiny-mesh", "tiny-base", "1+2R2+1", "PIQA", "MMLU", "acc_norm", "val PPL",
                 "non-emb. params"):
        assert name in page
    # two Table-1s and the loops table: header + two runs each; the exit table: header + 2 runs x 3
    # rules
    assert page.count("<tr>") == 2 * 3 + 3 + 7 and "state:inf" in page and "avg loops/token" in page
    images = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert len(images) == 3 + 6  # loss curves, loss vs loops, exit frontier + the six probe figures
    assert not re.search(r"(src|href)=['\"](http|file|/)", page)  # self-contained
    assert "--limit 10" in page  # the fake suites were "limited": the note says so
    saved = sorted(p.name for p in (tmp_path / "figures").iterdir() if p.name != outputs.MARKER)
    names = ("curves", "loops", "exit", "updates", "cka", "cka_steps", "spectrum", "rank", "router")
    assert saved == sorted(f"{n}.{fmt}" for n in names for fmt in ("png", "svg", "pdf"))
    assert (tmp_path / "figures" / "loops.svg").read_text().lstrip().startswith("<?xml")
    assert (tmp_path / "figures" / "loops.pdf").read_bytes().startswith(b"%PDF")
    # every task score with its standard error (1.00 points), the 8-task average with sqrt(8 x
    # 0.01²) / 8
    table = page[page.index("id='table'"):page.index("id='training'")]
    assert table.count("<small>± 1.00</small>") == 2 * 2 * len(SUITE)
    assert (table.count(f"<small>± {100 * math.sqrt(len(SUITE) * 1e-4) / len(SUITE):.2f}</small>")
            == 2 * 2)
    assert "10,240 tokens, final training loss 4.0000, validation loss 4.1000" in page


def test_eval_and_probe_files_keep_their_keys_and_read_back_unchanged(runs):
    """The keys meshlm eval and meshlm probe have written all along (no tasks here: no downstream
    scores but the fake suites); what the one reader gives back writes the same JSON."""
    saved = json.loads((runs[0] / "eval.json").read_text())
    assert list(saved) == ["checkpoint", "step", "model", "accounting", "complete", "perplexity",
                           "loops", "exit", "downstream", "seconds"]
    assert list(saved["perplexity"]) == ["loss", "ppl", "tokens", "sequences", "data", "split",
                                         "seq_len"]
    assert list(saved["loops"][0]) == ["loops", "trained", "loss", "ppl", "tokens", "sequences"]
    assert list(saved["exit"][0]) == ["exit", "max_loops", "loss", "ppl", "tokens", "sequences",
                                      "avg_loops", "avg_probes", "flops_ratio"]
    piqa = saved["downstream"]["0"]["tasks"]["piqa"]
    assert set(piqa) == {"acc", "acc_norm", "metric", "score", "stderr", "items"}
    probed = json.loads((runs[0] / "probe" / "probe.json").read_text())
    assert {"write_usage", "slots", "max_entropy", "per_sample"} <= set(probed)  # the mesh run
    for run in runs:
        files = ((run / "eval.json", read_eval), (run / "probe" / "probe.json", read_probe))
        for path, read in files:
            assert read(path).to_dict() == json.loads(path.read_text())


def test_loss_curves_come_from_metrics_with_tokens_for_every_validation(runs):
    curves = collect(runs[0]).curves
    # the cut line skipped
    assert curves["train"][0] == (512, pytest.approx(5.9)) and len(curves["train"]) == 20
    # step 10: 10 × 512
    assert curves["val"] == [(5120, pytest.approx(5.1)), (10240, pytest.approx(4.1))]


def test_table_one_shows_perplexity_without_downstream_results(runs, tmp_path):
    from meshlm.analysis.report import render

    results = [collect(r) for r in runs]
    for r in results:
        r.eval = dataclasses.replace(r.eval, downstream={})
    results[1].eval = None  # only training's validation: its last perplexity, marked
    page = render(results, figures={})
    table = page[page.index("id='table'"):page.index("id='training'")]
    assert f"{results[0].eval.perplexity.ppl:.2f}" in table
    assert (re.search(rf"{math.exp(4.2):.2f}(</b>)?<sup>†</sup>", table)
            and "No downstream results yet" in table)
    assert "PIQA" not in table


def test_report_collects_from_a_checkpoint_path_and_explains_missing_results(runs, tmp_path):
    (runs[1] / "eval.json").rename(tmp_path / "moved.json")
    try:
        results = [collect(runs[0] / "step-000001"), collect(runs[1])]
        assert (results[0].name == "tiny-mesh" and results[1].eval is None
                and results[1].model["scheme"] == "base")
        assert f"meshlm eval {runs[1]}" in notes(results)
        table = table_one(results, "0")
        assert table.count("<td>—</td>") == len(SUITE) + 1  # base: no task scores, no average
        assert "<sup>†</sup>" in table  # its perplexity: the trainer's last validation
    finally:
        (tmp_path / "moved.json").rename(runs[1] / "eval.json")
    with pytest.raises(MeshlmError, match="meshlm eval"):
        collect(tmp_path)


def test_probe_figures_are_pngs(runs):
    results = [(r.name, read_probe(r / "probe" / "probe.json")) for r in runs]
    figures = plots.probe_figures(results)
    assert set(figures) == {"updates", "cka", "cka_steps", "spectrum", "rank", "router"}
    assert plots.png_bytes(figures["router"]).startswith(b"\x89PNG")
    assert "router" not in plots.probe_figures(results[1:])  # base has no routers


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
IMAGE_PROBE = """<script>
window.addEventListener("load", () => {
  const images = [...document.images].map(i => i.complete && i.naturalWidth > 0 ? 1 : 0);
  document.body.setAttribute("data-images", images.join(""));
});
</script>"""


def chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run",
             f"--user-data-dir={profile}",
             "--virtual-time-budget=10000"]
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=180)


@pytest.mark.skipif(CHROMIUM is None,
                    reason="no chromium (setup.sh installs the Debian package as root)")
def test_report_renders_in_headless_chromium_with_every_figure_loaded(runs, tmp_path):
    out = tmp_path / "report.html"
    assert main(["report", *map(str, runs), "--out", str(out), "--title", "two tiny runs"]) == 0
    page = out.read_text()
    probed = tmp_path / "probed.html"  # the page plus a script that records which images decoded
    probed.write_text(page.replace("</body>", IMAGE_PROBE + "</body>"))
    dom = chromium("--dump-dom", probed.as_uri(), profile=tmp_path / "profile")
    assert dom.returncode == 0, dom.stderr[-2000:]
    loaded = re.search(r'data-images="([01]*)"', dom.stdout)
    assert (loaded
            and loaded.group(1) == "1" * page.count("<img ")), "an <img> did not load in Chromium"
    shot = tmp_path / "report.png"
    done = chromium(f"--screenshot={shot}", "--window-size=1400,3000", "--hide-scrollbars",
                    out.as_uri(),
                    profile=tmp_path / "profile")
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    from PIL import Image

    with Image.open(shot) as image:
        assert image.size == (1400, 3000)
        # text and figures, not blank
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 20) or []) > 50
