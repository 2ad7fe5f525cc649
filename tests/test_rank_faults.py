"""A rank that is stopped (SIGSTOP) or killed under torchrun (two CPU processes, gloo): the other
fails within train.collective_timeout with one line naming that rank (PID, state, step) and how to
go on, instead of waiting out a 30-minute process-group timeout (meshlm.train.watchdog).
tests/faultkit.py has the same two faults as rows of docs/errors.md."""
from __future__ import annotations

import pytest
from trainkit import RANK_TIMEOUT_S, train_with_rank_fault


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["stopped", "killed"])
def test_the_other_rank_fails_naming_the_one_that_hangs_or_dies(prepared, tmp_path, fault):
    code, stderr, pids = train_with_rank_fault(prepared, tmp_path, fault)
    assert code != 0
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert (len(errors) == 1 and errors[0] == stderr.strip().splitlines()[-1]
            and "Traceback" not in stderr), stderr
    words = ("is stopped (SIGSTOP or a debugger)" if fault == "stopped"
             else "has exited (killed or crashed)")
    # a stopped rank is found by the watchdog only; a killed one by the collective that fails when
    # its connection closes, or by the watchdog when the survivor was still short of that
    # collective after the timeout (a step slower than the timeout on a loaded machine)
    timeout = f"no step for train.collective_timeout={RANK_TIMEOUT_S}s"
    whys = (timeout,) if fault == "stopped" else ("its connection closed", timeout)
    assert errors[0].startswith(f"meshlm train: error: rank 1 (PID {pids[1]} on "), errors[0]
    assert words in errors[0] and "--resume" in errors[0], errors[0]
    assert any(why in errors[0] for why in whys), errors[0]
