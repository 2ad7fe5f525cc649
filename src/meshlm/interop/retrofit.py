"""Retrofit: a recursive (looped) or MeSH model initialised from a trained vanilla stack of any
backbone — a GPT-NeoX (Pythia), Llama-family or OLMoE Hugging Face folder, or a vanilla meshlm
checkpoint.

The paper trains from scratch and has no recipe for this; meshlm's is:

    source layers 0 … L−1 (e.g. Pythia-410M, L = 24)      target spec "P+CrK+D" (e.g. "4+8R2+4")
    ┌──────────┬─────────────────────────────────┬──────────┐
    │ 0 … P−1  │  middle: M = L − P − D layers   │ L−D … L−1│
    └──────────┴─────────────────────────────────┴──────────┘
      prelude     cut into blocks of C layers          coda
                  block 0 = P … P+C−1, block 1, …

- Prelude and coda are the first P and last D source layers, unchanged; embeddings, final norm and
  output layer are copied. Only layer weights are touched, so this is the same for every backbone
  (an OLMoE core averages expert e with expert e of the other blocks: experts are not aligned across
  layers, so prefer `block` there).
- The middle M layers are what the looped core(s) replace. If M = Σ C·K (the looped model keeps the
  source's unrolled depth and compute), core c replaces the K_c consecutive blocks that its K_c
  passes line up with. With a single core, any M that C divides works (M / C blocks; a shallower
  loop than the source).
- The shared core is initialised from those blocks: `block` takes one of them as is (`block_index`,
  default 0 = the first), `average` takes the layer-wise mean of all of them (layer i of the core =
  mean of layer i of each block). Averaging keeps every source block's contribution; taking a block
  keeps one exact trained function. Both then need continued training: the loop applies the core to
  states it never saw.
- MeSH routers start (default `router_start="base"`) biased (β = 6, ≈99% weight for B = 5) to write
  step t into its own slot t+1 and read it straight back, so the retrofitted MeSH model starts as
  plain recursion h^{t+1} ≈ f_core(h^t) — the source's own computation with the shared core in place
  of the blocks — and learns to mix slots from there (a softmax at β = 6 still passes gradient).
  Near-uniform routers (`router_start="fresh"`, meshlm's init) would instead start every read as an
  average of all slots, far from the source's function (docs/backbones.md measures both). Other
  schemes' parameters keep meshlm's init.
- Embedding scaling follows the source (Pythia: none), since the layers were trained on unscaled
  inputs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from meshlm import checkpoint, outputs
from meshlm.config import Layout, ModelConfig, parse_spec
from meshlm.errors import ConfigError
from meshlm.interop.families import unique_layer_names
from meshlm.loading import open_model
from meshlm.model import MeshLM
from meshlm.model.memory import Router

CORE_INITS = ("block", "average")
ROUTER_STARTS = ("fresh", "base")
BASE_ROUTER_BIAS = 6.0


@dataclass
class Plan:
    """Source layer indices for every target layer."""

    prelude: list[int]
    cores: list[list[list[int]]]  # per core: the blocks it replaces, each a list of C source layers
    coda: list[int]


def plan(source_depth: int, spec: str) -> Plan:
    """Which source layers become prelude, the blocks each core replaces, and coda; ConfigError if
    it doesn't fit."""
    layout = parse_spec(spec)
    p, d, L = layout.prelude, layout.coda, source_depth
    middle = L - p - d
    unrolled = sum(c * k for c, k in zip(layout.cores, layout.repeats))
    if middle < sum(layout.cores):
        raise ConfigError(f"retrofit spec {spec!r} does not fit the {L}-layer source: prelude {p} "
                          f"+ cores {sum(layout.cores)} + coda {d} need "
                          f"{p + sum(layout.cores) + d} layers; {_suggest(layout, L)}")
    if middle == unrolled:
        block_counts = list(layout.repeats)
    elif len(layout.cores) == 1 and middle % layout.cores[0] == 0:
        block_counts = [middle // layout.cores[0]]
    else:
        raise ConfigError(f"retrofit spec {spec!r} does not fit the {L}-layer source: the {middle} "
                          f"middle layers neither equal the unrolled core depth {unrolled} nor "
                          f"split into whole blocks of the core; {_suggest(layout, L)}")
    cores, start = [], p
    for c, n_blocks in zip(layout.cores, block_counts):
        cores.append([list(range(start + b * c, start + (b + 1) * c)) for b in range(n_blocks)])
        start += n_blocks * c
    return Plan(prelude=list(range(p)), cores=cores, coda=list(range(L - d, L)))


def _suggest(layout: Layout, depth: int) -> str:
    """A spec with the same loop count that fits `depth` (prelude/coda shrunk or grown as
    needed)."""
    k, p, d = layout.repeats[0], layout.prelude, layout.coda
    while p + d + k > depth and (p or d):
        p, d = (p - 1, d) if p >= d else (p, d - 1)
    middle = depth - p - d
    if middle < k:
        return f"choose P + C·K + D = {depth}"
    return f'choose P + C·K + D = {depth}, e.g. "{p}+{middle // k}R{k}+{d + middle % k}"'


def retrofit(source_cfg: ModelConfig, source_state: dict[str, torch.Tensor], spec: str,
             scheme: str = "mesh",
             core_init: str = "average", block_index: int = 0, router_start: str = "base",
             scheme_options: dict[str, Any] | None = None, seed: int = 0) -> tuple[MeshLM, Plan]:
    """A new MeshLM with `spec`/`scheme`, its layers taken from a vanilla source model's state
    dict."""
    if source_cfg.layout.shares_weights or source_cfg.scheme not in ("vanilla", "base"):
        raise ConfigError("retrofit needs a vanilla source model, not scheme "
                          f"{source_cfg.scheme!r} with spec {source_cfg.spec!r}")
    if core_init not in CORE_INITS or router_start not in ROUTER_STARTS:
        raise ConfigError(f"core_init={core_init!r} / router_start={router_start!r}: choose "
                          f"core_init from {CORE_INITS} and router_start from {ROUTER_STARTS}")
    layers = plan(source_cfg.layout.unique_depth, spec)
    cfg = source_cfg.replace(spec=spec, scheme=scheme, scheme_options=dict(scheme_options or {}))
    torch.manual_seed(seed)
    model = MeshLM(cfg)  # scheme parameters keep meshlm's init
    state = model.state_dict()
    source_names = unique_layer_names(source_cfg.layout)
    for key in [k for k in state if not k.startswith(("prelude.", "cores.", "coda.", "scheme."))]:
        state[key] = source_state[key].clone()  # embeddings, final norm, output layer
    target_names = unique_layer_names(cfg.layout)
    for name, sources in zip(target_names, _layer_sources(layers, core_init, block_index)):
        for key in [k for k in state if k.startswith(name + ".")]:
            rest = key[len(name) + 1:]
            stacked = torch.stack([source_state[f"{source_names[i]}.{rest}"].float()
                                   for i in sources])
            # one source layer: itself; several: the layer-wise average
            state[key] = stacked.mean(0)
    model.load_state_dict(state)
    if router_start == "base" and cfg.scheme == "mesh":
        _base_routers(model)
    return model.eval(), layers


def _layer_sources(layers: Plan, core_init: str, block_index: int) -> list[list[int]]:
    """Source layers feeding each target unique layer, in meshlm order (prelude, cores, coda)."""
    out = [[i] for i in layers.prelude]
    for blocks in layers.cores:
        if core_init == "block":
            if not -len(blocks) <= block_index < len(blocks):
                raise ConfigError(f"block_index={block_index} is out of range: the core replaces "
                                  f"{len(blocks)} blocks (0 … {len(blocks) - 1})")
            out += [[i] for i in blocks[block_index]]
        else:
            out += [list(group) for group in zip(*blocks)]  # layer i of every block
    return out + [[i] for i in layers.coda]


@torch.no_grad()
def _base_routers(model: MeshLM) -> None:
    """Router pair t writes into slot t+1 and reads it back: MeSH starts as plain recursion."""
    routers = [m for m in model.scheme.modules() if isinstance(m, Router)]
    slots = routers[0].slots
    if slots < len(routers) + 1:
        raise ConfigError(f"router_start='base' needs slots >= K + 2 = {len(routers) + 1}; got "
                          f"{slots}")
    for pair, router in enumerate(routers):
        router.weight.zero_()
        router.bias.zero_()
        router.bias[pair + 1] = BASE_ROUTER_BIAS  # write column
        router.bias[slots + pair + 1] = BASE_ROUTER_BIAS  # read column


def retrofit_folder(src: str | Path, out: str | Path, spec: str, overwrite: bool = False,
                    **options: Any) -> Path:
    """Retrofit any vanilla model folder meshlm.loading opens (a GPT-NeoX / Llama / OLMoE folder, a
    vanilla meshlm checkpoint or run) and write a step-0 meshlm checkpoint carrying the source's
    tokenizer. `out` must be new or empty, or an earlier retrofit output with `overwrite`
    (meshlm.outputs.claim, before any work)."""
    outputs.claim(out, "retrofit", overwrite, [src], label="output")
    source = open_model(src)
    model, layers = retrofit(source.model.config, source.model.state_dict(), spec, **options)
    meta = {"source": {"format": source.format, "path": str(src)},
            "retrofit": {"spec": spec,
                         **{k: v for k, v in options.items() if k != "scheme_options"},
                         "layers": asdict(layers)}}
    saved = checkpoint.save_model(model, out, meta, source.tokenizer_file)
    outputs.mark(saved, "retrofit")
    return saved
