"""Everything that wraps the model from outside ("wrap, don't weave"): devices, precision,
activation checkpointing, torch.compile, DDP/FSDP2, and full state dicts for saving.

Wrapping order (torchtitan's): checkpoint each layer → compile each layer → FSDP2 per layer + root,
or DDP around the whole model. Checkpointing and compile act in place on each layer (any
`meshlm.model.layers.Layer`: NeoX, Llama or OLMoE; an instance-level forward / `Module.compile`), so
parameter names never change. The trainer keeps the unwrapped `MeshLM` for state dicts; under FSDP2
that same object holds sharded DTensor parameters and `full_model_state` gathers them (a collective:
every rank must call it).

A looped core runs each of its layers K times per forward; DDP accumulates the K contributions
before its reducer fires, and FSDP2 re-gathers the layer at each use and reduces once per backward
use (checked against a single process in tests/test_distributed.py).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from meshlm.errors import ConfigError
from meshlm.model.layers import Layer
from meshlm.model.recompute import checkpoint_layers
from meshlm.runtime import compile as compile_policy
from meshlm.runtime import precision
from meshlm.runtime.devices import device_problem
from meshlm.train.plan import RunPlan
from meshlm.train.watchdog import group_timeout

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 gets every tensor, on CPU


@dataclass
class Env:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    precision: precision.Precision  # bf16 autocast or plain fp32, and why
    compile: compile_policy.Compile  # torch.compile each layer or not, and why

    @property
    def autocast_dtype(self) -> torch.dtype | None:  # None = plain fp32
        return self.precision.dtype

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def setup(plan: RunPlan) -> Env:
    """Pick the device and precision; join the process group when launched by torchrun."""
    cfg = plan.cfg
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    problem = device_problem(cfg.device, "train.device")
    if problem:
        raise ConfigError(problem)
    if want_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if want_cuda else "gloo",
                                timeout=group_timeout(cfg.collective_timeout))
    chosen = precision.choose(cfg.dtype, device)
    compiling = compile_policy.choose(cfg.compile, device, plan.total_steps)
    return Env(rank, world, local_rank, device, chosen, compiling)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def autocast(env: Env):
    """bf16 autocast (weights and optimizer stay fp32), or nothing for fp32."""
    return precision.autocast(env.device, env.precision)


def layers(model: nn.Module) -> list[Layer]:
    return [m for m in model.modules() if isinstance(m, Layer)]


def compile_layers(model: nn.Module) -> None:
    """torch.compile every layer in place (`Module.compile`): names and weights unchanged, and a
    shared core layer compiles once for all its K uses."""
    for layer in layers(model):
        layer.compile()


def wrap(model: nn.Module, plan: RunPlan, env: Env) -> nn.Module:
    """Returns the module to call for training; `model` itself stays the handle for state dicts."""
    cfg = plan.cfg
    if cfg.activation_checkpointing:
        checkpoint_layers(model)
    if env.compile.enabled:
        compile_layers(model)
    if not env.distributed:
        return model
    if cfg.distributed == "fsdp":
        for layer in layers(model):
            fully_shard(layer)
        fully_shard(model)  # root: embeddings, scheme, final norm, head
        return model
    ids = [env.local_rank] if env.device.type == "cuda" else None
    # a sampled or truncated depth leaves some per-step parameters (MeSH routers past the drawn
    # count or in the no-grad steps) without a gradient; every rank draws the same count, so all
    # skip the same ones
    elastic = plan.loops.sampled or cfg.backprop_loops > 0
    return DistributedDataParallel(model, device_ids=ids, find_unused_parameters=elastic)


def no_sync(wrapped: nn.Module, sync: bool):
    """Skip gradient reduction on all but the last micro-batch of an accumulation."""
    if hasattr(wrapped, "set_requires_gradient_sync"):  # FSDP2
        wrapped.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if hasattr(wrapped, "no_sync") and not sync:  # DDP
        return wrapped.no_sync()
    return contextlib.nullcontext()


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, unsharded, on CPU (filled on rank 0; collective under FSDP)."""
    return get_model_state_dict(model, options=FULL)


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Optimizer state keyed by parameter name, so it loads under any wrapping or world size."""
    return get_optimizer_state_dict(model, optimizer, options=FULL)


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, weights: dict,
                    optim: dict | None):
    """Load full (unsharded) state into a possibly sharded model; every rank passes the full dicts.

    The model's weights must match exactly. The optimizer state may lack parameters that never had a
    gradient (AdamW creates state at a parameter's first gradient: e.g. MeSH routers of loop counts
    not drawn yet), which is exactly the state the uninterrupted run holds."""
    set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
    if optimizer is not None and optim is not None:
        set_optimizer_state_dict(model, optimizer, optim,
                                 options=StateDictOptions(full_state_dict=True, strict=False))


def all_mean(value: torch.Tensor, env: Env) -> torch.Tensor:
    if env.distributed:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= env.world
    return value


def all_max(value: torch.Tensor, env: Env) -> torch.Tensor:
    if env.distributed:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value


def all_sum(value: torch.Tensor, env: Env) -> torch.Tensor:
    if env.distributed:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def barrier(env: Env) -> None:
    if env.distributed:
        dist.barrier()


def broadcast_object(obj, env: Env):
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
