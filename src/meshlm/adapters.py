"""LoRA through PEFT on a MeshLM, which parameters train, and merging the adapters back into the
base weights.

LoRA (`train.lora_rank` = r > 0) is PEFT's (`inject_adapter_in_model`): the model stays a MeshLM
(its loop, cache, exit and speculation untouched); each targeted Linear becomes a PEFT `lora.Linear`
around it. A Linear of a shared core is one module run on every pass, so its adapter is one delta
shared by all passes (for one delta per pass, see per-loop LoRA: `model.loop_lora_rank`,
meshlm.model.loop_lora).

`train.lora_targets` picks the Linears, comma-separated:
    attention, mlp              the layer projections of that kind
                                (each layer class's `roles`)
    prelude, core, coda         restrict to those stacks (alone: every Linear of their layers)
    routers                     MeSH's router pairs train in full (a Linear(d, 2B): a low-rank delta
                                of it saves nothing, and its forward returns weights, not a tensor
                                PEFT can add to)
    anything else               a layer-local name suffix, e.g. query_key_value or mlp.down_proj
A selection matching no Linear (and no routers) is a ConfigError.

`train.trainable` says which parameters get gradients (and so optimizer state; the others are
frozen): "all", or comma-separated roles: lora (PEFT's adapters), loop_lora (per-loop deltas),
routers, scheme, embeddings, prelude, core, coda. Empty: "all" without LoRA; with it "lora" (plus
routers if targeted).

A checkpoint of a LoRA run holds the base weights and the adapters under PEFT's names
(`…base_layer.weight`, `…lora_A.default.weight`), so resuming restores both;
`meshlm.loading.open_model` rebuilds the adapters from the checkpoint's training config and merges
them (PEFT's merge: W + (α/r)·B A), giving a plain MeshLM that every command, `meshlm convert`
(meshlm or Hugging Face) included, uses as any other.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshlm.config import ModelConfig
from meshlm.errors import ConfigError
from meshlm.model import MeshLM
from meshlm.model.loop_lora import ROLES, example_target, targets_of
from meshlm.trainable import SECTIONS, trainable_roles, words

_PREFIX = {"routers": ("scheme.routers.",), "scheme": ("scheme.",),
           "embeddings": ("embed_in.", "embed_out."),
           "prelude": ("prelude.",), "core": ("cores.",), "coda": ("coda.",)}


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: str
    dropout: float = 0.0

    @classmethod
    def of(cls, train: dict[str, Any]) -> LoraSpec | None:
        """From a TrainConfig's fields (a dict: a checkpoint's saved "train" works too); None
        without LoRA."""
        rank = int(train.get("lora_rank") or 0)
        if rank == 0:
            return None
        alpha = train.get("lora_alpha")
        return cls(rank, float(alpha) if alpha else 2.0 * rank,
                   str(train.get("lora_targets") or "attention,mlp"),
                   float(train.get("lora_dropout") or 0.0))

    @property
    def trains_routers(self) -> bool:
        return "routers" in words(self.targets)

    def apply(self, model: nn.Module) -> nn.Module:
        return apply_lora(model, self)

    @staticmethod
    def merge(model: nn.Module) -> nn.Module:
        return merge_lora(model)


def target_names(model: nn.Module, targets: str) -> list[str]:
    """Full names of the plain Linears `targets` picks (routers excluded: they train in full)."""
    picked = [w for w in words(targets) if w != "routers"]
    sections = [w for w in picked if w in SECTIONS] or list(SECTIONS)
    kinds = ",".join(w for w in picked if w not in SECTIONS) or ",".join(ROLES)
    stacks = {"prelude": [("prelude", model.prelude)], "coda": [("coda", model.coda)],
              "core": [(f"cores.{i}", core) for i, core in enumerate(model.cores)]}
    return [f"{prefix}.{j}.{name}" for section in sections for prefix, stack in stacks[section]
            for j, layer in enumerate(stack) for name in targets_of(layer, kinds)]


def rank_problem(model_cfg: ModelConfig, train: dict[str, Any]) -> str | None:
    """Why `train`'s LoRA rank does not fit the model `model_cfg` describes, else None: a rank
    r >= min(in, out) of the narrowest Linear it adapts is full rank there, so it trains more values
    than the layer has (r·(in + out) against in·out) and saves nothing. The model is built on the
    meta device: no memory, no weights read. A selection matching nothing is apply_lora's error."""
    spec = LoraSpec.of(train)
    if spec is None:
        return None
    with torch.device("meta"):
        model = MeshLM(model_cfg)
    widths = {name: min(module.in_features, module.out_features)
              for name in target_names(model, spec.targets)
              if hasattr(module := model.get_submodule(name), "in_features")}
    if not widths or spec.rank < min(widths.values()):
        return None
    narrowest = min(widths, key=widths.__getitem__)
    return (f"lora_rank={spec.rank} is not below the width of {narrowest} ({widths[narrowest]}), "
            f"the narrowest layer lora_targets={spec.targets!r} adapts: that is full rank, with "
            f"more values to train than the layer has; pass train.lora_rank="
            f"{widths[narrowest] - 1} or less (train.lora_rank=0 trains the full weights)")


def apply_lora(model: nn.Module, spec: LoraSpec) -> nn.Module:
    """Inject PEFT LoRA adapters into `model` in place (B = 0: the outputs are unchanged); returns
    it."""
    from peft import LoraConfig, inject_adapter_in_model

    names = target_names(model, spec.targets)
    if not names and not (spec.trains_routers and hasattr(model.scheme, "routers")):
        raise ConfigError(f"lora_targets={spec.targets!r} matches no Linear of this "
                          f"{model.config.backbone} model; use roles attention, mlp, prelude, "
                          "core, coda, routers or layer-local names such as "
                          f"{example_target(model.config.backbone)!r}")
    if names:
        config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                            target_modules=names)
        inject_adapter_in_model(config, model)
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every PEFT adapter into its base Linear (PEFT's merge) and put the base Linear back: the
    plain model."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge()
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, module.get_base_layer())
    return model


def set_trainable(model: nn.Module, roles: list[str]) -> int:
    """requires_grad on exactly the parameters of `roles`; returns how many values train
    (ConfigError if none)."""
    def picked(name: str) -> bool:
        return ("all" in roles or ("lora" in roles and (".lora_A." in name or ".lora_B." in name))
                or ("loop_lora" in roles and ".loop_lora." in name)
                or any(name.startswith(_PREFIX[r]) for r in roles if r in _PREFIX))

    total = 0
    for name, p in model.named_parameters():
        p.requires_grad_(picked(name))
        total += p.numel() if p.requires_grad else 0
    if total == 0:
        raise ConfigError(f"trainable={','.join(roles)} selects no parameter of this model (no "
                          "per-loop LoRA, routers or adapters there?); choose roles it has")
    return total


def adapt(model: nn.Module, train: dict[str, Any]) -> int:
    """What a training config asks of the model before the optimizer sees it: LoRA, then the
    trainable set."""
    spec = LoraSpec.of(train)
    if spec is not None:
        apply_lora(model, spec)
    return set_trainable(model, trainable_roles(str(train.get("trainable") or ""), spec))
