"""The trainer: it learns, skips and aborts on non-finite losses, survives SIGKILL bit-for-bit, and
turns bad input into one clear line and a non-zero exit."""
from __future__ import annotations

import json
import math
import random
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file
from trainkit import ROOT, as_overrides, cli, cli_command, run_dir, tiny_train, train_losses

from meshlm.cli import main
from meshlm.folders import integrity
from meshlm.loading import open_model
from meshlm.model import MeshLM
from meshlm.train.trainer import NonFiniteLossError, train


def test_training_lowers_the_loss(prepared, tmp_path):
    cfg = tiny_train(prepared, tmp_path, steps=30, micro_batch=8, save_every=0, eval_every=15)
    result = train(cfg)
    losses = [result.losses[s] for s in sorted(result.losses)]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    assert math.isfinite(result.val_loss) and result.val_ppl < math.exp(losses[0])
    assert result.checkpoint.name == "step-000030"
    model = open_model(result.run_dir).model
    assert isinstance(model, MeshLM) and not model.training


def poison(monkeypatch, bad_steps):
    """Make the training forward of the given (1-based) optimizer steps return a NaN loss."""
    forward, calls = MeshLM.forward, {"n": 0}

    def patched(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if self.training:
            calls["n"] += 1  # one forward per step (accumulation 1 in these tests)
            if calls["n"] in bad_steps:
                out.loss = out.loss * math.nan
        return out

    monkeypatch.setattr(MeshLM, "forward", patched)


def test_non_finite_steps_are_skipped(prepared, tmp_path, monkeypatch):
    poison(monkeypatch, {3, 4})
    cfg = tiny_train(prepared, tmp_path, steps=6, micro_batch=8, save_every=2)
    result = train(cfg)
    assert (math.isnan(result.losses[3]) and math.isnan(result.losses[4])
            and math.isfinite(result.losses[6]))
    kinds = [line for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
             if '"skip"' in line]
    assert len(kinds) == 2
    weights = load_file(str(result.run_dir / "step-000004" / "model.safetensors"))
    same = load_file(str(result.run_dir / "step-000002" / "model.safetensors"))
    # skipped steps leave weights untouched
    assert all(torch.equal(weights[k], same[k]) for k in weights)


def test_too_many_non_finite_steps_abort(prepared, tmp_path, monkeypatch):
    poison(monkeypatch, set(range(2, 100)))
    cfg = tiny_train(prepared, tmp_path, steps=10, micro_batch=8, save_every=1, max_nonfinite=3)
    with pytest.raises(NonFiniteLossError, match="3 steps in a row"):
        train(cfg)
    for path in integrity.list_checkpoints(run_dir(cfg)):  # all saved is finite and loadable
        open_model(path)


def test_sigkill_then_resume_is_bit_identical(prepared, tmp_path):
    """Kill a real training process at a random step, resume it, compare with an uninterrupted
    run."""
    steps = 16
    ref_cfg = tiny_train(prepared, tmp_path / "ref", steps=steps, save_every=3)
    done = cli("train", *as_overrides(ref_cfg))
    assert done.returncode == 0, done.stderr

    cfg = tiny_train(prepared, tmp_path / "killed", steps=steps, save_every=3)
    kill_at = random.randint(4, steps - 3)  # printed on failure, so a failing draw can be replayed
    cmd, env = cli_command("train", *as_overrides(cfg))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = run_dir(cfg) / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(train_losses(run_dir(cfg))) >= kill_at:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"run finished before the kill at step {kill_at}"
    assert len(train_losses(run_dir(cfg))) < steps

    resumed = cli("train", *as_overrides(cfg), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed" in resumed.stderr, resumed.stderr
    ref, got = train_losses(run_dir(ref_cfg)), train_losses(run_dir(cfg))
    assert got == ref, f"kill at step {kill_at}"
    final = f"step-{steps:06d}/model.safetensors"
    a, b = load_file(str(run_dir(ref_cfg) / final)), load_file(str(run_dir(cfg) / final))
    assert all(torch.equal(a[k], b[k]) for k in a), f"kill at step {kill_at}"


def test_resume_skips_a_corrupt_latest_checkpoint(prepared, tmp_path, capsys):
    cfg = tiny_train(prepared, tmp_path, steps=8, save_every=4)
    train(cfg)
    latest = run_dir(cfg) / "step-000008" / "model.safetensors"
    latest.write_bytes(latest.read_bytes()[:100])  # truncated
    rc = main(["train", *as_overrides(cfg), "steps=10", "--resume"])
    err = capsys.readouterr().err
    assert rc == 0
    assert str(latest) in err and "truncated" in err and "resumed" in err and "step-000004" in err


def test_resuming_a_finished_run_says_so_instead_of_a_speed(prepared, tmp_path, capsys):
    cfg = tiny_train(prepared, tmp_path, steps=4, save_every=4)
    train(cfg)
    assert main(["train", *as_overrides(cfg), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "already trained: 4 steps" in out and "tokens/s" not in out


@pytest.mark.parametrize("overrides, needle", [
    (["seq_len=512"], "exceeds the model's context_length"),
    (["model.vocab_size=1000"], "set the model vocab_size to at least 8192"),
    (["data=/nonexistent/prepared"], "does not exist"),
    (["steps=0", "tokens=0"], "set steps or tokens"),
    (["not-an-override"], "not key=value"),
])
def test_bad_input_is_one_line_and_exit_2(prepared, tmp_path, capsys, overrides, needle):
    cfg = tiny_train(prepared, tmp_path)
    rc = main(["train", *as_overrides(cfg), *overrides])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and needle in err and len(err.splitlines()) == 1, err


def test_refuses_to_overwrite_a_run_and_resumes_only_good_checkpoints(prepared, tmp_path, capsys):
    cfg = tiny_train(prepared, tmp_path, steps=4, save_every=4)
    train(cfg)
    assert main(["train", *as_overrides(cfg)]) == 2
    assert "--resume" in capsys.readouterr().err
    state = run_dir(cfg) / "step-000004" / "state.pt"
    state.write_bytes(b"garbage")
    # a runtime failure, not a usage error
    assert main(["train", *as_overrides(cfg), "--resume"]) == 1
    assert "no usable checkpoint" in capsys.readouterr().err


def test_activation_checkpointing_changes_nothing_but_memory(prepared, tmp_path):
    plain = train(tiny_train(prepared, tmp_path / "plain", steps=3, save_every=0))
    ckpt = train(tiny_train(prepared, tmp_path / "ckpt", steps=3, save_every=0,
                            activation_checkpointing=True))
    assert ckpt.losses == plain.losses
    a, b = open_model(plain.run_dir).model.state_dict(), open_model(ckpt.run_dir).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    names = MeshLM(tiny_train(prepared, tmp_path).derive_model()).state_dict()
    assert set(a) == set(names)  # names unchanged


def test_bf16_autocast_path_runs(prepared, tmp_path):
    """The GPU precision path, exercised on CPU (bf16 is emulated here: tiny shapes only)."""
    result = train(tiny_train(prepared, tmp_path, steps=2, micro_batch=8, save_every=0,
                              dtype="bf16"))
    assert all(math.isfinite(v) for v in result.losses.values()) and math.isfinite(result.val_loss)
    weights = load_file(str(result.run_dir / "step-000002" / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in weights.values())  # autocast: fp32 master weights


def test_moe_runs_log_the_language_model_loss_and_the_router_losses(prepared, tmp_path):
    model = {"preset": "tiny-olmoe", "vocab_size": 8192, "scheme": "mesh", "aux_loss_weight": 0.05}
    result = train(tiny_train(prepared, tmp_path, model=model, steps=3, save_every=0))
    rows = [r for r in map(json.loads, (result.run_dir / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"]
    assert len(rows) == 3
    # loss = lm + 0.05 aux + 0.001 z; aux >= top_k = 2 (its minimum, at balanced routing), z > 0
    for r in rows:
        assert r["loss"] == pytest.approx(r["lm_loss"] + 0.05 * r["aux_loss"] + 0.001 * r["z_loss"],
                                          abs=1e-5)
        assert 2 - 1e-4 < r["aux_loss"] < 2.5 and r["z_loss"] > 0 and r["lm_loss"] > 5
    dense = train(tiny_train(prepared, tmp_path, name="dense", steps=1, save_every=0))
    # no MoE, no router columns
    assert "aux_loss" not in (dense.run_dir / "metrics.jsonl").read_text()
