"""`meshlm describe`: parameter counts, depth and FLOPs of a config, without allocating its
weights."""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="mesh-small", help="named config (see --list)")
    p.add_argument("--spec", help='layer layout, e.g. "4+8R2+4", "4+8+8+4" or "24"')
    p.add_argument("--scheme",
                   help="state scheme, e.g. mesh, base, anchor, anchor*, residual, static-mix")
    p.add_argument("--slots", type=int, help="MeSH buffer size B (default K+3)")
    p.add_argument("--max-loops", type=int,
                   help="deepest loop count with its own MeSH router pair (default K)")
    p.add_argument("--routing",
                   help="MeSH routing: learned (default) or uniform (the frozen-router ablation)")
    p.add_argument("--loop-lora-rank", type=int,
                   help="per-loop LoRA rank on the shared core (default 0: none)")
    p.add_argument("--context", type=int,
                   help="context length for attention FLOPs (default: the config's)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--list", action="store_true", help="list the presets and schemes, then exit")


def run(args: argparse.Namespace) -> int:
    from meshlm.config import PRESETS, ModelConfig
    from meshlm.model.accounting import describe
    from meshlm.model.schemes import SCHEMES

    if args.list:
        print("presets:", ", ".join(PRESETS))
        print("schemes:", ", ".join(SCHEMES), "(anchor* = anchor-emb)")
        return 0
    if args.context is not None and args.context < 1:
        from meshlm.errors import ConfigError

        raise ConfigError(f"--context {args.context} must be >= 1 (tokens of attention context)")
    cfg = ModelConfig.from_preset(args.preset, **preset_overrides(args))
    acc = describe(cfg, args.context)
    if args.json:
        print(json.dumps({"preset": args.preset, "config": cfg.to_dict(), **acc.to_dict()},
                         indent=2))
        return 0
    rows = table_rows(args.preset, cfg, acc)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def preset_overrides(args: argparse.Namespace) -> dict:
    """The ModelConfig fields the flags set over the preset's (scheme options nested)."""
    overrides = {k: v for k, v in (("spec", args.spec), ("scheme", args.scheme)) if v is not None}
    options = {k: v for k, v in (("slots", args.slots), ("routing", args.routing)) if v is not None}
    if options:
        overrides["scheme_options"] = options
    if args.max_loops is not None:
        overrides["max_loops"] = args.max_loops
    if args.loop_lora_rank is not None:
        overrides["loop_lora_rank"] = args.loop_lora_rank
    return overrides


def table_rows(preset: str, cfg, acc) -> list[tuple[str, object]]:
    """(label, value) rows of the table for a config (meshlm.config.ModelConfig) and its
    accounting (meshlm.model.accounting.Accounting)."""
    return [
        ("preset", preset), ("spec", cfg.spec), ("scheme", cfg.scheme),
        ("backbone", cfg.backbone),
        ("d_model / heads / kv heads", f"{cfg.d_model} / {cfg.n_heads} / {cfg.kv_heads}"),
        ("vocab", f"{cfg.vocab_size:,}"),
        *([("experts / per token", f"{acc.experts} / {acc.experts_per_token}")] if acc.experts
          else []),
        ("layers unique / unrolled", f"{acc.unique_layers} / {acc.unrolled_layers}"),
        ("loop steps / cap (max_loops)", f"{acc.loop_steps} / {acc.loop_cap}"),
        ("MeSH slots B", acc.slots if acc.slots else "-"),
        ("MeSH router pairs", acc.router_pairs if acc.router_pairs is not None else "-"),
        ("params total", f"{acc.total_params:,}"),
        ("params embedding", f"{acc.embedding_params:,}"),
        ("params non-embedding", f"{acc.non_embedding_params:,}"),
        ("params scheme", f"{acc.scheme_params:,}"),
        *([("params per-loop LoRA", f"{acc.loop_lora_params:,}")] if acc.loop_lora_params else []),
        *([("params active (per token)", f"{acc.active_params:,}"),
           ("params active non-embedding", f"{acc.active_non_embedding_params:,}")] if acc.experts
          else []),
        (f"forward FLOPs/token @ {acc.context_length}" + (" (active)" if acc.experts else ""),
         f"{acc.forward_flops_per_token:,}"),
        ("  of which scheme",
         f"{acc.scheme_flops_per_token:,} "
         f"({100 * acc.scheme_flops_per_token / acc.forward_flops_per_token:.4f}%)"),
        ("train FLOPs/token", f"{acc.train_flops_per_token:,}"),
    ]
