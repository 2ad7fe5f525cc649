"""One owner per run folder (meshlm.train.ownership): a second training in a busy folder refuses
with one line naming the owner, a dead owner is taken over with a warning, a clean exit leaves
nothing to warn about."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from trainkit import as_overrides, cli, cli_command, run_dir, tiny_train, train_losses

from meshlm.train.ownership import OWNER_FILE, RunFolderBusy, RunOwner, owner_problem

HOLD = ("import sys, time; from meshlm.train.ownership import RunOwner\n"
        "with RunOwner(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)")


def holder(run_dir):
    """A separate process that holds the folder's lock until killed."""
    cmd, env = cli_command()
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_busy_folder_is_refused_naming_its_owner(tmp_path):
    proc = holder(tmp_path / "run")
    try:
        with pytest.raises(RunFolderBusy,
                           match=f"is in use by PID {proc.pid} on .*train under another name"):
            RunOwner(tmp_path / "run").__enter__()
        assert f"PID {proc.pid}" in owner_problem(tmp_path / "run")
    finally:
        proc.kill()
        proc.wait()


def test_a_dead_owner_is_taken_over_with_a_warning_and_a_clean_exit_leaves_no_record(tmp_path):
    proc = holder(tmp_path / "run")
    # dies holding the lock: the kernel releases it, the record stays
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert owner_problem(tmp_path / "run") is None
    warnings = []
    with RunOwner(tmp_path / "run", warnings.append):
        record = json.loads((tmp_path / "run" / OWNER_FILE).read_text())
        assert record["pid"] != proc.pid and record["host"]
    assert (len(warnings) == 1 and f"from PID {proc.pid}" in warnings[0]
            and "no longer running" in warnings[0])
    assert (tmp_path / "run" / OWNER_FILE).read_text() == ""
    with RunOwner(tmp_path / "run", warnings.append):
        pass
    assert len(warnings) == 1


@pytest.mark.slow
def test_a_second_training_with_the_same_name_refuses_and_the_first_finishes_intact(prepared,
                                                                                    tmp_path):
    """The data loss this prevents: two `meshlm train` of one name both ran to the end in one
    folder, each deleting the other's metrics and checkpoints, both exiting 0."""
    cfg = tiny_train(prepared, tmp_path, steps=60, save_every=20)
    cmd, env = cli_command("train", *as_overrides(cfg))
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)
    owner = run_dir(cfg) / OWNER_FILE
    deadline = time.time() + 120
    while time.time() < deadline and not (owner.is_file() and owner.read_text().strip()):
        time.sleep(0.05)
    # paused while the second starts, so the first still holds the folder however fast it trains
    first.send_signal(signal.SIGSTOP)
    try:
        second = cli("train", *as_overrides(tiny_train(prepared, tmp_path, steps=60,
                                                       save_every=20, lr=1e-3)))
    finally:
        first.send_signal(signal.SIGCONT)
    out, err = first.communicate(timeout=300)
    assert second.returncode == 2, second.stderr
    assert f"is in use by PID {first.pid}" in second.stderr and second.stderr.count("error:") == 1
    assert first.returncode == 0, err
    losses = train_losses(run_dir(cfg))
    assert sorted(losses) == list(range(1, 61))  # the first run's metrics, whole
    assert owner.read_text() == ""
