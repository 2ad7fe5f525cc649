"""The `meshlm` command line: describe, errors as one line with a non-zero exit code."""
import json
import subprocess
import sys

from meshlm.cli import main


def test_describe_prints_the_paper_counts(capsys):
    assert main(["describe", "--preset", "pythia-1.4b-4+8R2+4", "--scheme", "mesh"]) == 0
    out = capsys.readouterr().out
    assert "805,797,918" in out and "61,470" in out and "16 / 24" in out


def test_describe_json(capsys):
    assert main(["describe", "--preset", "pythia-410m-3+6R3+3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["scheme_params"] == 49_200 and data["slots"] == 6
    assert data["config"]["spec"] == "3+6R3+3"


def test_describe_overrides(capsys):
    assert main(["describe", "--preset", "pythia-410m-4+8R2+4", "--slots", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["scheme_params"] == 2 * 3 * 3 * 1025


def test_bad_config_is_one_line_and_exit_code_2():
    proc = subprocess.run([sys.executable, "-m", "meshlm.cli", "describe", "--spec", "4+8R0+4",
                           "--scheme", "x"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshlm describe: error: invalid model config:")
    assert "8R0" in lines[0] and "scheme='x'" in lines[0]


def test_list(capsys):
    assert main(["describe", "--list"]) == 0
    out = capsys.readouterr().out
    assert "pythia-1.4b-4+8R2+4" in out and "mesh" in out


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    """`meshlm <args>` in this process: (exit code, stdout, stderr)."""
    try:
        code = main(list(args))
    except SystemExit as stop:  # argparse: --version, usage errors
        code = stop.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_version(capsys):
    from importlib.metadata import version

    code, out, _ = run_main(capsys, "--version")
    assert code == 0 and out.strip() == f"meshlm {version('meshlm')}"


def test_usage_errors_exit_2_runtime_errors_exit_1(tmp_path, capsys):
    usage = run_main(capsys, "eval", str(tmp_path), "--limit", "0")
    runtime = run_main(capsys, "report", str(tmp_path / "nothing-here"))
    assert usage[0] == 2 and runtime[0] == 1, (usage, runtime)
    for _, out, err in (usage, runtime):
        assert not out and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_debug_shows_the_traceback(capsys, monkeypatch):
    monkeypatch.setenv("MESHLM_DEBUG", "")
    calls = [["--debug", "describe", "--spec", "4+8R0+4"], ["describe", "--spec", "x", "--debug"]]
    results = [run_main(capsys, *call) for call in calls]
    monkeypatch.setenv("MESHLM_DEBUG", "1")
    results.append(run_main(capsys, "describe", "--spec", "x"))
    for code, _, err in results:
        assert code == 2 and "Traceback (most recent call last)" in err
        assert err.strip().splitlines()[-1].startswith("meshlm describe: error: invalid model "
                                                       "config")


def test_an_unavailable_device_is_one_line_in_every_command(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for command in (["eval", str(tmp_path)], ["probe", str(tmp_path)],
                    ["generate", str(tmp_path), "hi"]):
        code, out, err = run_main(capsys, *command, "--device", "cuda")
        assert (code == 2 and "--device cuda but no CUDA device is visible; use --device cpu or "
                              "auto" in err), err
        assert len(err.strip().splitlines()) == 1 and not out
    code, out, err = run_main(capsys, "train", "train.device=cuda", "train.data=/nonexistent")
    assert (code == 2
            and "train.device=cuda but no CUDA device is visible; use train.device=cpu" in err)
    assert "train.data=/nonexistent" in err  # both problems in one message
