"""Outputs never overwrite what a command did not create (meshlm.outputs): for each command that
writes a folder, a folder of someone else's files is refused and left byte for byte, the source is
never the target (--overwrite or not), and a rerun into the command's own earlier output needs
--overwrite and then works. Also the resource bound that goes with it: a LoRA rank as wide as its
layers is refused before anything is prepared."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import build, tiny
from evalkit import tiny_checkpoint
from trainkit import make_prepared

from meshlm import outputs
from meshlm.checkpoint import save_model
from meshlm.cli import main
from meshlm.errors import ConfigError
from meshlm.folders.integrity import verify

NOTES = b"my notes: not meshlm's to touch\n"
QUICK = ["--bits", "8", "--seq-len", "16", "--calibration", "2", "--no-report"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return make_prepared(tmp_path_factory)


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, prepared):
    """A run folder with one checkpoint of an untrained tiny MeSH model, on `prepared`."""
    return tiny_checkpoint(tmp_path_factory.mktemp("runs"), "mesh", prepared)


@pytest.fixture
def run(base_run, tmp_path):
    """This test's own copy of the run (commands write into it)."""
    return Path(shutil.copytree(base_run, tmp_path / base_run.name))


def notes(folder: Path) -> Path:
    """`folder` holding a user's notes.txt."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_bytes(NOTES)
    return folder


def files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder`, by relative path: what must be left exactly as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def refused(capsys, argv: list[str], needle: str) -> str:
    """`meshlm argv` exits 2 with one line holding `needle`."""
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err, err
    return err


def ok(capsys, argv: list[str]) -> None:
    assert main([str(a) for a in argv]) == 0, capsys.readouterr().err
    capsys.readouterr()


# -- the rule itself -------------------------------------------------------------------------------
def test_claim_takes_new_empty_and_own_folders_and_refuses_the_rest(tmp_path):
    assert outputs.claim(tmp_path / "new", "convert") == tmp_path / "new"
    (tmp_path / "empty").mkdir()
    assert outputs.claim(tmp_path / "empty", "convert") == tmp_path / "empty"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file; pass a folder path"):
        outputs.claim(tmp_path / "file", "convert")
    mine = notes(tmp_path / "notes")
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match="holds files that meshlm convert did not write"):
            outputs.claim(mine, "convert", overwrite)
    assert files(mine) == {"notes.txt": NOTES}
    own = tmp_path / "own"
    own.mkdir()
    outputs.mark(own, "convert")
    with pytest.raises(ConfigError, match="earlier meshlm convert output; pass --overwrite"):
        outputs.claim(own, "convert")
    assert outputs.claim(own, "convert", overwrite=True) == own
    with pytest.raises(ConfigError, match="did not write"):  # another command's output
        outputs.claim(own, "retrofit", overwrite=True)


def test_the_source_is_never_the_target_but_may_hold_it(tmp_path):
    source = tmp_path / "run"
    source.mkdir()
    outputs.mark(source, "convert")  # even an earlier output of the same command
    for target, where in ((source, "is"), (tmp_path, "holds")):
        with pytest.raises(ConfigError, match=f"{where} the source .*--overwrite or not"):
            outputs.claim(target, "convert", True, [source])
    assert outputs.claim(source / "w8a8", "quantize", sources=[source]) == source / "w8a8"
    # a Hub name (no such path here) is no folder to compare
    assert outputs.claim(tmp_path / "out", "convert", sources=["org/model"])


def test_outputs_from_before_markers_are_recognised_by_what_they_hold(tmp_path, prepared):
    assert outputs.made_by(prepared) == "prepare"  # prepared data: its manifest
    quantized = tmp_path / "q"
    save_model(build(tiny()), quantized, {"quantization": {"bits": 8}})
    assert outputs.made_by(quantized) == "quantize"
    save_model(build(tiny()), tmp_path / "plain")
    assert outputs.made_by(tmp_path / "plain") is None
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "probe.json").write_text("{}")
    assert outputs.made_by(tmp_path / "probe") == "probe"


def test_the_marker_is_outside_the_checkpoint_manifest(tmp_path):
    folder = save_model(build(tiny()), tmp_path / "m")
    outputs.mark(folder, "retrofit")
    assert verify(folder)["step"] == 0
    assert json.loads((folder / outputs.MARKER).read_text())["command"] == "retrofit"


def test_a_run_folder_is_a_new_or_empty_one_or_a_runs_own(tmp_path, base_run):
    assert outputs.claim_run(tmp_path / "new") == tmp_path / "new"
    (tmp_path / "stopped").mkdir()  # a run stopped before its first checkpoint
    (tmp_path / "stopped" / ".owner").write_text("")
    assert outputs.claim_run(tmp_path / "stopped")
    assert outputs.claim_run(base_run)  # checkpoints: train's rules decide (--resume)
    with pytest.raises(ConfigError, match="holds files that no meshlm training wrote"):
        outputs.claim_run(notes(tmp_path / "notes"))
    with pytest.raises(ConfigError, match="is the source"):
        outputs.claim_run(base_run, [base_run])
    with pytest.raises(ConfigError, match="holds the source"):
        outputs.claim_run(base_run, [base_run / "step-000001"])


# -- per command -----------------------------------------------------------------------------------
def test_quantize(run, tmp_path, capsys):
    before = files(run)
    refused(capsys, ["quantize", run, *QUICK, "--out", run, "--overwrite"], "is the source")
    refused(capsys, ["quantize", run, *QUICK, "--out", tmp_path], "holds the source")
    assert files(run) == before  # every checkpoint and metrics file still there
    mine = notes(tmp_path / "notes")
    refused(capsys, ["quantize", run, *QUICK, "--out", mine, "--overwrite"], "did not write")
    assert files(mine) == {"notes.txt": NOTES}
    ok(capsys, ["quantize", run, *QUICK])  # the default, inside the run: RUN/w8a8
    refused(capsys, ["quantize", run, *QUICK], "pass --overwrite")
    ok(capsys, ["quantize", run, *QUICK, "--overwrite"])
    assert verify(run / "w8a8")["quantization"]["bits"] == 8
    assert {k: v for k, v in files(run).items() if not k.startswith("w8a8")} == before


@pytest.mark.skipif(not os.path.isdir("/proc") or shutil.disk_usage("/proc").total != 0,
                    reason="no /proc filesystem of size 0 here")
def test_quantize_into_proc_says_files_cannot_be_created_there(run, capsys):
    err = refused(capsys, ["quantize", run, *QUICK, "--out", "/proc/q"],
                  "/proc is not a place files can be created")
    assert "no space left" not in err and "choose a folder on a disk" in err


def test_convert_refuses_the_source_and_other_files(run, tmp_path, capsys):
    before = files(run)
    refused(capsys, ["convert", run, run, "--to", "hf", "--overwrite"], "is the source")
    assert files(run) == before
    mine = notes(tmp_path / "notes")
    refused(capsys, ["convert", run, mine, "--to", "hf", "--overwrite"], "did not write")
    assert files(mine) == {"notes.txt": NOTES}


@pytest.mark.slow
def test_convert_replaces_its_own_output_with_overwrite(run, tmp_path, capsys):
    out = tmp_path / "hf"
    ok(capsys, ["convert", run, out, "--to", "hf"])
    refused(capsys, ["convert", run, out, "--to", "hf"], "pass --overwrite")
    ok(capsys, ["convert", run, out, "--to", "hf", "--overwrite"])
    refused(capsys, ["convert", out, out, "--overwrite"], "is the source")  # its own output too
    from meshlm.hf import load_hf

    assert load_hf(out).config.num_hidden_layers > 0  # transformers ignores the marker


def test_retrofit(tmp_path, capsys):
    source = save_model(build(tiny(spec="4", scheme="vanilla", vocab_size=8192)), tmp_path / "v")
    before = files(source)
    args = ["--spec", "1+1R2+1"]
    refused(capsys, ["retrofit", source, source, *args, "--overwrite"], "is the source")
    assert files(source) == before
    mine = notes(tmp_path / "notes")
    refused(capsys, ["retrofit", source, mine, *args, "--overwrite"], "did not write")
    assert files(mine) == {"notes.txt": NOTES}
    out = tmp_path / "mesh"
    ok(capsys, ["retrofit", source, out, *args])
    refused(capsys, ["retrofit", source, out, *args], "pass --overwrite")
    ok(capsys, ["retrofit", source, out, *args, "--overwrite"])
    assert verify(out)["retrofit"]["spec"] == "1+1R2+1"


def test_prepare(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"d{i}.txt").write_text(f"document {i}: " + "some words here. " * 50)
    before = files(corpus)
    quiet = ["--quiet", "--val-fraction", "0.25"]
    refused(capsys, ["prepare", corpus, "-o", corpus, "--overwrite", *quiet], "is the source")
    assert files(corpus) == before
    mine = notes(tmp_path / "notes")
    refused(capsys, ["prepare", corpus, "-o", mine, "--overwrite", *quiet], "did not write")
    refused(capsys, ["prepare", "task:chase", "-o", mine, "--overwrite"], "did not write")
    assert files(mine) == {"notes.txt": NOTES}
    out = tmp_path / "data"
    ok(capsys, ["prepare", corpus, "-o", out, *quiet])
    refused(capsys, ["prepare", corpus, "-o", out, *quiet], "pass --overwrite")
    ok(capsys, ["prepare", corpus, "-o", out, "--overwrite", *quiet])
    assert not (out / outputs.MARKER).exists()  # prepared data: its manifest is the record


PROBE = ["--samples", "2", "--tokens", "16"]


def test_probe_refuses_the_source_and_other_files(run, tmp_path, capsys):
    mine = notes(tmp_path / "notes")
    refused(capsys, ["probe", run, *PROBE, "--out", mine, "--overwrite"], "did not write")
    assert files(mine) == {"notes.txt": NOTES}
    before = files(run)
    refused(capsys, ["probe", run, *PROBE, "--out", run, "--overwrite"], "is the source")
    assert files(run) == before


@pytest.mark.slow
def test_probe_replaces_its_own_output_with_overwrite(run, capsys):
    quick = PROBE
    ok(capsys, ["probe", run, *quick])  # the default: RUN/probe
    refused(capsys, ["probe", run, *quick], "pass --overwrite")
    ok(capsys, ["probe", run, *quick, "--overwrite"])
    assert (run / "probe" / "probe.json").is_file()


def test_report_figures_refused_before_any_work(run, tmp_path, capsys):
    mine = notes(tmp_path / "notes")
    refused(capsys, ["report", run, "--figures", mine, "--overwrite"], "did not write")
    assert files(mine) == {"notes.txt": NOTES}
    before = files(run)
    refused(capsys, ["report", run, "--figures", run, "--overwrite"], "is the source")
    assert files(run) == before


def test_tasks_export_into_a_folder_of_other_files_is_refused(tmp_path, capsys):
    mine = notes(tmp_path / "notes")
    refused(capsys, ["tasks", "export", mine, "--overwrite"], "did not write")
    assert files(mine) == {"notes.txt": NOTES}


def test_finetune_never_trains_in_a_folder_of_other_files_or_the_source(run, tmp_path, capsys,
                                                                        monkeypatch):
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"prompt": "2+2=", "completion": "4"}) + "\n")
    mine = notes(tmp_path / "notes")
    refused(capsys, ["finetune", run, data, f"train.out_dir={tmp_path}", "train.name=notes"],
            "holds files that no meshlm training wrote")
    assert files(mine) == {"notes.txt": NOTES}
    before = files(run)
    refused(capsys, ["finetune", run, data, f"train.out_dir={tmp_path}", f"train.name={run.name}",
                     "--resume"], "is the source")
    assert files(run) == before
    # tiny: d_model 64, its narrowest adapted Linear 64 wide
    refused(capsys, ["finetune", run, data, "train.lora_rank=100000", f"train.out_dir={tmp_path}"],
            "lora_rank=100000 is not below the width of")
    refused(capsys, ["finetune", run, data, "train.lora_rank=64", f"train.out_dir={tmp_path}"],
            "pass train.lora_rank=63 or less")
    assert not (tmp_path / "cache").exists()  # refused before the data were prepared
