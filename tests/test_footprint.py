"""The training memory estimate (exact state bytes, what sharding and checkpointing change) and the
schedule warnings; the refusals themselves are rows of tests/faultkit.py."""
from __future__ import annotations

import torch

from meshlm.model.accounting import describe
from meshlm.train.config import TrainConfig
from meshlm.train.footprint import estimate, memory_problem, schedule_problem, schedule_warnings


def config(**overrides) -> TrainConfig:
    return TrainConfig(**{"model": {"preset": "tiny", "vocab_size": 8192}, "seq_len": 32,
                          **overrides})


def test_state_is_16_bytes_per_parameter_and_fsdp_shards_it():
    cfg = config()
    model_cfg = cfg.derive_model()
    params, state, activations = estimate(cfg, model_cfg, 32, world=1, bf16=False)
    assert params == describe(model_cfg).total_params and state == 16 * params and activations > 0
    _, sharded, same = estimate(config(distributed="fsdp"), model_cfg, 32, world=4, bf16=False)
    assert sharded == state / 4 and same == activations


def test_activations_follow_the_micro_batch_precision_and_checkpointing():
    model_cfg = config().derive_model()
    act = lambda bf16=False, **kw: estimate(config(**kw), model_cfg, 32, 1, bf16)[2]  # noqa: E731
    logits = 2 * 8 * 32 * 8192 * 4  # fp32 logits and their gradient, either way
    assert act(micro_batch=4) - logits / 2 == (act(micro_batch=8) - logits) / 2
    assert act(bf16=True) - logits == (act() - logits) / 2
    assert act(activation_checkpointing=True) < act()


def test_a_run_that_fits_is_not_refused():
    cfg = config()
    assert memory_problem(cfg, cfg.derive_model(), 32, torch.device("cpu"), 1) is None


def test_schedule_warnings_and_the_absurd_step_count():
    assert schedule_warnings(config(steps=300), 300, 32) == []
    both = schedule_warnings(config(steps=10, tokens=1000, save_every=0, eval_every=0), 10, 32)
    assert both == ["train.tokens=1,000 is ignored because train.steps=10 is set; set "
                    "train.steps=0 to train by tokens"]
    short = schedule_warnings(config(steps=0, tokens=100, save_every=0, eval_every=0), 1, 32)
    assert short == ["train.tokens=100 is less than one step (global_batch x seq_len tokens); "
                     "training 1 step"]
    # 10,000 epochs: allowed
    assert schedule_problem(config(steps=10_000), 10_000, windows=8) is None
    assert "passes over the 8 training windows 10,001 times" in schedule_problem(config(), 10_001,
                                                                                 windows=8)
