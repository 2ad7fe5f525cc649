"""Every bad input and fault of tests/faultkit.py gets its exit code and one clear line, with no
traceback, nothing on stdout before an error, nothing lost or left behind, and the row
docs/errors.md shows for it."""
from __future__ import annotations

import pytest
from faultkit import CASES, DOC, build_world, message, normalise, row, run_case


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("faults-world"))


@pytest.mark.parametrize("case",
                         [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.slow else [])
                          for c in CASES])
def test_bad_input(case, world, tmp_path):
    code, out, err = run_case(case, tmp_path, world)
    shown = message(case, err)
    assert code == case.code, err
    assert "Traceback" not in err, err
    if 0 < code < 128:
        # nothing echoed before an error (an interrupt may stop work that printed)
        assert not out, out
    if code != 0:
        assert shown.startswith(
            f"meshlm {'' if case.command == 'meshlm' else case.command + ': '}".rstrip()), err
        assert sum("error:" in line or "stopped:" in line for line in err.splitlines()) == 1, err
    assert case.needle in shown, err
    if case.after:
        case.after(tmp_path)
    assert row(case,
               normalise(shown, tmp_path, world)) in DOC.read_text(), "run scripts/errors_table.py"


def test_the_table_lists_every_case_once():
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| ")
            and not line.startswith("| command")]
    assert len(rows) == len(CASES) >= 60
    commands = {c.command for c in CASES}
    assert {"describe", "prepare", "fetch", "train", "generate", "convert", "retrofit", "eval",
            "probe",
            "reproduce", "report"} <= commands
