"""What a training run needs before it starts: memory that fits the device, and a schedule that
makes sense.

`memory_problem` estimates one rank's training memory from the config alone (the model is built on
the meta device, so nothing is allocated) and compares it with what the device has free:
    state        16 B per parameter: fp32 weights 4 + gradients 4 + AdamW's two moments 8 (FSDP: /
                 world);
    activations  what backward keeps for one micro-batch: ~34 values per token and d_model per layer
                 application (Korthikanti et al. 2022, "Reducing Activation Recomputation", with
                 memory-efficient attention, so no s² scores), at 2 B under bf16 autocast and 4 B in
                 fp32; every loop pass of a looped core counts (up to the sampled-depth cap);
                 activation checkpointing keeps one layer's plus every layer's input; plus the
                 logits and their gradient (fp32, vocabulary-sized);
    ranks sharing a host's RAM (torchrun on CPU) each need their own.
A run is refused only when the estimate exceeds what is free, so the message is never a false alarm
about a run that would fit; one that fits the estimate may still run out at the margin (allocator,
buffers). Measured on this CPU (mesh-small, 256 tokens, 2 steps, peak RSS growth): micro_batch 8
fp32 estimate 472 MB vs 642 MB measured, bf16 329 vs 531 MB, micro_batch 16 fp32 892 vs 1,226 MB:
the estimate is a lower bound (~60-75%).

`schedule_warnings` lists settings a run accepts but that rarely mean what was intended (a save
interval longer than the run, `tokens` ignored because `steps` is set); `schedule_problem` refuses a
step count that repeats the data absurdly often (1e12 steps: warmup alone would take 1e10 of them).
"""
from __future__ import annotations

import math
import os

import torch

from meshlm.config import ModelConfig
from meshlm.model.accounting import describe

STATE_BYTES_PER_PARAM = 16
ACTIVATION_VALUES_PER_TOKEN_AND_WIDTH = 34
MAX_EPOCHS = 10_000  # more passes over the training data than this is a typo, not a plan


def gigabytes(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def available_bytes(device: torch.device) -> tuple[float, str]:
    """(free bytes, what they are) of `device`: a GPU's free memory, or the host's MemAvailable."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return float(free), f"{torch.cuda.get_device_name(device)} has"
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024, "this machine has"
    except OSError:
        pass
    return float("inf"), "this machine has"  # unknown: nothing to refuse on


def estimate(cfg, model_cfg: ModelConfig, seq_len: int, world: int, bf16: bool) -> tuple[int, float,
                                                                                         float]:
    """(parameters, state bytes, activation bytes) of one rank."""
    params = describe(model_cfg).total_params
    state = STATE_BYTES_PER_PARAM * params / (world if cfg.distributed == "fsdp" else 1)
    layout = model_cfg.layout
    passes = max(layout.n_steps, model_cfg.max_loops or 0)  # sampled depth: up to its cap
    if len(layout.cores) == 1:
        applications = layout.prelude + layout.coda + layout.cores[0] * passes
    else:
        applications = layout.unrolled_depth
    tokens, width, value = cfg.micro_batch * seq_len, model_cfg.d_model, 2 if bf16 else 4
    per_layer = ACTIVATION_VALUES_PER_TOKEN_AND_WIDTH * tokens * width * value
    kept = (per_layer + applications * tokens * width
            * value) if cfg.activation_checkpointing else \
        applications * per_layer
    logits = 2 * tokens * model_cfg.vocab_size * 4
    return params, state, kept + logits


def memory_problem(cfg, model_cfg: ModelConfig, seq_len: int, device: torch.device,
                   world: int) -> str | None:
    """A one-line refusal when the run cannot fit `device`'s free memory; None when it may."""
    # auto picks bf16 where it is native; elsewhere 2 B undercounts: never a false alarm
    bf16 = cfg.dtype != "fp32"
    params, state, activations = estimate(cfg, model_cfg, seq_len, world, bf16)
    sharing = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if device.type == "cpu" else 1
    need = (state + activations) * sharing
    free, where = available_bytes(device)
    if need <= free:
        return None
    per_rank = f" x {sharing} ranks on this host" if sharing > 1 else ""
    return (f"training needs about {gigabytes(need)}{per_rank} ({params / 1e6:,.0f}M parameters: "
            f"weights, gradients and AdamW state at {STATE_BYTES_PER_PARAM} B each = "
            f"{gigabytes(state)}; activations of one micro-batch of {cfg.micro_batch} x {seq_len} "
            f"tokens about {gigabytes(activations)}), but {where} {gigabytes(free)} free; use a "
            "smaller model (model.d_model, the spec), lower train.micro_batch or train.seq_len, "
            "or set train.activation_checkpointing=true")


def schedule_problem(cfg, total_steps: int, windows: int) -> str | None:
    """A step count that repeats `windows` training windows more than MAX_EPOCHS times."""
    epochs = total_steps * cfg.global_batch / max(1, windows)
    if epochs <= MAX_EPOCHS:
        return None
    one_epoch = math.ceil(windows / cfg.global_batch)
    return (f"train.steps={total_steps:,} x global_batch={cfg.global_batch} passes over the "
            f"{windows:,} training windows {epochs:,.0f} times (warmup alone is "
            f"{math.ceil(cfg.warmup * total_steps):,} steps); one pass is {one_epoch:,} steps: set "
            "train.steps to a multiple of that")


def schedule_warnings(cfg, total_steps: int, seq_len: int) -> list[str]:
    """Settings a run of `total_steps` steps of `seq_len`-token sequences accepts that rarely mean
    what was intended."""
    out = []
    for name, what in (("save_every",
                        "the only checkpoint is the final one (a crash loses the whole run)"),
                       ("eval_every", "the only validation is at the end"),
                       ("log_every", "no step is logged before the end")):
        every = getattr(cfg, name)
        if every > total_steps:
            out.append(f"train.{name}={every} exceeds the run's {total_steps} steps: {what}; set "
                       f"train.{name}={total_steps} or less")
    if cfg.steps and cfg.tokens:
        out.append(f"train.tokens={cfg.tokens:,} is ignored because train.steps={cfg.steps} is "
                   "set; set train.steps=0 to train by tokens")
    if not cfg.steps and total_steps == 1 and cfg.tokens < cfg.global_batch * seq_len:
        out.append(f"train.tokens={cfg.tokens:,} is less than one step (global_batch x seq_len "
                   f"tokens); training 1 step")
    if cfg.warmup and total_steps > 1 and math.ceil(cfg.warmup * total_steps) >= total_steps:
        out.append(f"train.warmup={cfg.warmup} of {total_steps} steps is all warmup: the learning "
                   "rate never decays; lower train.warmup")
    return out
