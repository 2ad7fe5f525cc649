"""The validation loss training reports is over one fixed set of windows, whatever micro_batch or
the world size (a memory knob must never change a metric)."""
from __future__ import annotations

import math

import pytest
from trainkit import tiny_train

from meshlm.data.order import validation_batches, window_indices
from meshlm.train import parallel
from meshlm.train.plan import resolve
from meshlm.train.trainer import Trainer, train


@pytest.mark.parametrize("n_windows, wanted", [(100, 16), (7, 16), (3, 128), (50, 50)])
def test_every_world_and_micro_batch_covers_the_same_windows_once(n_windows, wanted):
    expected = window_indices(n_windows, wanted)
    for world in (1, 2, 3, 4, 8):
        for micro in (1, 2, 3, 8):
            ranks = [validation_batches(n_windows, wanted, micro, rank, world)
                     for rank in range(world)]
            # the same number of forwards on every rank (FSDP)
            assert len({len(r) for r in ranks}) == 1
            counted = [i for r in ranks for chunk, keep in r if keep for i in chunk]
            assert counted == expected
            assert all(len(chunk) <= micro for r in ranks for chunk, _ in r)


def test_micro_batch_does_not_change_the_validation_loss(prepared, tmp_path):
    """Same weights, micro_batch 8 vs 4 vs 3: the same windows, so the same loss (to float
    rounding)."""
    losses = []
    for micro in (8, 4, 2):
        cfg = tiny_train(prepared, tmp_path / str(micro), micro_batch=micro, eval_windows=24)
        plan = resolve(cfg)
        losses.append(Trainer(plan, parallel.setup(plan)).evaluate())
    assert (losses[1] == pytest.approx(losses[0], rel=1e-6)
            and losses[2] == pytest.approx(losses[0], rel=1e-6))


def test_trained_runs_differing_only_in_micro_batch_report_the_same_validation_loss(prepared,
                                                                                    tmp_path):
    # fp32: under bf16 autocast (chosen where the CPU has native bf16) accumulation rounds
    # differently
    a = train(tiny_train(prepared, tmp_path / "a", steps=4, micro_batch=8, dtype="fp32"))
    # 2 accumulation steps
    b = train(tiny_train(prepared, tmp_path / "b", steps=4, micro_batch=4, dtype="fp32"))
    assert all(math.isclose(a.losses[s], b.losses[s], rel_tol=1e-6) for s in a.losses)
    assert b.val_loss == pytest.approx(a.val_loss, rel=1e-5)
