"""Ctrl-C / SIGTERM during training: a checkpoint at the current step, advice to resume, exit 130 /
143, and a resumed run that is bit-identical to an uninterrupted one; a second Ctrl-C aborts at
once."""
from __future__ import annotations

import signal
import subprocess
import time

import torch
from safetensors.torch import load_file
from trainkit import ROOT, as_overrides, cli, cli_command, run_dir, tiny_train, train_losses

from meshlm.folders import integrity


def start_and_signal(cfg, at_step: int, signals: list[int]) -> subprocess.CompletedProcess:
    """Run `meshlm train` in a subprocess; once it logged `at_step` steps, send `signals`, each
    after the process reported the previous one (its stderr line), so none is merged with the next
    by the kernel."""
    cmd, env = cli_command("train", *as_overrides(cfg))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    metrics, deadline = run_dir(cfg) / "metrics.jsonl", time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(train_losses(run_dir(cfg))) >= at_step:
            break
        time.sleep(0.005)
    err = []
    for i, sig in enumerate(signals):
        proc.send_signal(sig)
        # wait for "SIGINT: stopping ..."
        while i + 1 < len(signals) and (line := proc.stderr.readline()):
            err.append(line)
            if "stopping after this step" in line:
                break
    out, rest = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "".join(err) + rest)


def test_sigint_saves_the_current_step_and_resume_is_bit_identical(prepared, tmp_path):
    steps = 40
    ref_cfg = tiny_train(prepared, tmp_path / "ref", steps=steps, save_every=0)
    assert cli("train", *as_overrides(ref_cfg)).returncode == 0

    # no periodic checkpoints at all
    cfg = tiny_train(prepared, tmp_path / "int", steps=steps, save_every=0)
    done = start_and_signal(cfg, 5, [signal.SIGINT])
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr and not done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("meshlm train: stopped: checkpoint ") and last.endswith("--resume"), last
    saved = integrity.list_checkpoints(run_dir(cfg))
    assert len(saved) == 1 and 5 <= integrity.verify(saved[0])["step"] < steps
    assert not list(run_dir(cfg).glob(".t*"))  # no temporary folder left

    resumed = cli("train", *as_overrides(cfg), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert train_losses(run_dir(cfg)) == train_losses(run_dir(ref_cfg))
    final = f"step-{steps:06d}/model.safetensors"
    a, b = load_file(str(run_dir(ref_cfg) / final)), load_file(str(run_dir(cfg) / final))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_exits_143_with_a_checkpoint(prepared, tmp_path):
    cfg = tiny_train(prepared, tmp_path, steps=400, save_every=0)
    done = start_and_signal(cfg, 3, [signal.SIGTERM])
    assert done.returncode == 143, done.stderr
    assert "meshlm train: stopped: checkpoint" in done.stderr and "Traceback" not in done.stderr
    assert integrity.list_checkpoints(run_dir(cfg))


def test_a_second_ctrl_c_aborts_at_once(prepared, tmp_path):
    cfg = tiny_train(prepared, tmp_path, steps=400, save_every=0,
                     model={"preset": "tiny", "vocab_size": 8192,
                            "d_model": 128,
                            "spec": "2+4R4+2"})
    done = start_and_signal(cfg, 2, [signal.SIGINT, signal.SIGINT])
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("meshlm train: stopped: interrupted")
    assert not list(run_dir(cfg).glob(".t*"))  # an abort during a save leaves no temporary folder
    for path in integrity.list_checkpoints(run_dir(cfg)):
        integrity.verify(path)
