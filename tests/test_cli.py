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
    proc = subprocess.run([sys.executable, "-m", "meshlm.cli", "describe", "--spec", "4+8R0+4", "--scheme", "x"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshlm describe: error: invalid model config:")
    assert "8R0" in lines[0] and "scheme='x'" in lines[0]


def test_list(capsys):
    assert main(["describe", "--list"]) == 0
    out = capsys.readouterr().out
    assert "pythia-1.4b-4+8R2+4" in out and "mesh" in out
