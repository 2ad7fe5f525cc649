"""A rank that is stopped (SIGSTOP) or killed under torchrun (two CPU processes, gloo): the other
fails within train.collective_timeout with one line naming that rank (PID, state, step) and how to
go on, instead of waiting out a 30-minute process-group timeout (meshlm.train.watchdog).
tests/faultkit.py has the same two faults as rows of docs/errors.md."""
from __future__ import annotations

import argparse
import contextlib
import io
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from trainkit import RANK_TIMEOUT_S, train_with_rank_fault

from meshlm.cli import report
from meshlm.train.interrupt import StopRequest
from meshlm.train.watchdog import KEY, DistributedError, RankWatch


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


def test_a_failed_collective_is_said_before_the_signal_handlers_go(monkeypatch, capsys):
    """torchrun SIGTERMs the survivor as soon as it reaps the dead rank; once StopRequest restores
    the default handler that signal ends the process at once, so the line must already be out
    (the CLI then prints nothing more), and a SIGTERM meanwhile adds no word after it."""
    monkeypatch.delenv("MESHLM_DEBUG", raising=False)
    out, said, seen = io.StringIO(), [], []
    watch = RankWatch(SimpleNamespace(distributed=False, rank=0, world=2), 4.0, out=out)
    watch.store = dist.HashStore()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped: its PID is gone from /proc
    watch.store.set(KEY.format(rank=1), f"3 {dead.pid} {watch.host}")
    stop = StopRequest(said.append)

    @contextlib.contextmanager
    def unwinding():  # what has been printed when the error reaches StopRequest's exit
        try:
            yield
        finally:
            seen.append(out.getvalue())

    with pytest.raises(DistributedError) as caught, stop, unwinding(), \
            watch.naming_failures(stop):
        raise RuntimeError("[gloo] Connection closed by peer")
    line = (f"meshlm train: error: rank 1 (PID {dead.pid} on {watch.host}, at step 3) has "
            "exited (killed or crashed): rank 0 stopped waiting for it (its connection closed)")
    assert seen == [out.getvalue()] and out.getvalue().startswith(line), out.getvalue()
    assert out.getvalue().count("\n") == 1 and caught.value.reported
    stop._handle(signal.SIGTERM, None)  # torchrun's signal, after the line
    assert said == [] and stop.signal == signal.SIGTERM
    assert report(argparse.Namespace(command="train"), caught.value) == 1
    assert capsys.readouterr().err == ""
