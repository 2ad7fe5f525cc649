"""Two CPU processes (torchrun, gloo) under DDP and FSDP2 train exactly like one process with the
same global batch; an FSDP-written checkpoint loads in a single process."""
from __future__ import annotations

import pytest
import torch
from trainkit import TORCHRUN, as_overrides, cli, run_dir, tiny_train, train_losses

from meshlm.loading import open_model
from meshlm.train.trainer import train

STEPS = 5


# Equalities across process layouts hold in fp32; under bf16 autocast (the policy's pick where the
# CPU has native bf16) FSDP's gathered-parameter arithmetic rounds differently from one process's
# (~3e-5 in the loss).
FP32 = dict(dtype="fp32")


@pytest.fixture(scope="module")
def single(prepared, tmp_path_factory):
    """The reference: one process, global batch 8 as 2 micro-batches of 4."""
    cfg = tiny_train(prepared, tmp_path_factory.mktemp("single"), steps=STEPS, save_every=0, **FP32)
    result = train(cfg)
    return result.losses, open_model(result.run_dir).model.state_dict()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_processes_match_one(prepared, tmp_path, single, mode):
    losses, weights = single
    # 4 per rank
    cfg = tiny_train(prepared, tmp_path, steps=STEPS, save_every=0, distributed=mode, **FP32)
    done = cli("train", *as_overrides(cfg), launcher=TORCHRUN)
    assert done.returncode == 0, done.stderr[-3000:]
    got = train_losses(run_dir(cfg))
    assert sorted(got) == sorted(losses)
    for step, loss in losses.items():
        assert abs(got[step] - loss) <= 1e-5, (step, got[step], loss)
    model = open_model(run_dir(cfg)).model  # written by rank 0 from gathered (FSDP: full) state
    for name, tensor in model.state_dict().items():
        # Adam turns ~1e-9 gradient differences on rarely seen embedding rows into ~1e-5 weight
        # differences
        torch.testing.assert_close(tensor, weights[name], atol=1e-4, rtol=0, msg=name)


def test_fsdp_run_resumes_under_fsdp(prepared, tmp_path):
    cfg = tiny_train(prepared, tmp_path, steps=3, save_every=3, distributed="fsdp")
    assert cli("train", *as_overrides(cfg), launcher=TORCHRUN).returncode == 0
    done = cli("train", *as_overrides(cfg), "steps=5", "--resume", launcher=TORCHRUN)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed" in done.stderr and "step-000003" in done.stderr
    assert sorted(train_losses(run_dir(cfg))) == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_sampled_depth_keeps_ranks_in_lockstep(prepared, tmp_path, mode):
    """Every rank draws the same loop count per step (MeSH routers of undrawn steps get no gradient
    on any rank), so two processes still train exactly like one."""
    depth = dict(steps=STEPS, save_every=0, loops="uniform:1-4", backprop_loops=2, **FP32)
    ref = train(tiny_train(prepared, tmp_path / "one", **depth))
    cfg = tiny_train(prepared, tmp_path / "two", distributed=mode, **depth)
    done = cli("train", *as_overrides(cfg), launcher=TORCHRUN)
    assert done.returncode == 0, done.stderr[-3000:]
    got = train_losses(run_dir(cfg))
    for step, loss in ref.losses.items():
        assert abs(got[step] - loss) <= 1e-5, (step, got[step], loss)
    weights = open_model(ref.run_dir).model.state_dict()
    for name, tensor in open_model(run_dir(cfg)).model.state_dict().items():
        torch.testing.assert_close(tensor, weights[name], atol=1e-4, rtol=0, msg=name)
