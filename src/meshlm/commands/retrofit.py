"""`meshlm retrofit SRC OUT --spec 4+8R2+4`: a looped / MeSH model initialised from a vanilla stack
(a GPT-NeoX/Pythia, Llama-family or OLMoE Hugging Face folder, or a vanilla meshlm checkpoint).

Prelude and coda are the first and last source layers; the shared core replaces the middle blocks,
taken as is (--core-init block --block N) or averaged (--core-init average). See
meshlm.interop.retrofit, docs/hf.md and docs/backbones.md. The output is a meshlm checkpoint (step
0) ready for continued training.
"""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source",
                   help="GPT-NeoX (Pythia), Llama or OLMoE folder, or a vanilla meshlm checkpoint")
    p.add_argument("out", help="output checkpoint folder: new, empty, or an earlier retrofit "
                               "output with --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier `meshlm retrofit` output in OUT (never other files)")
    p.add_argument("--spec", required=True,
                   help='target layout, e.g. "4+8R2+4" for a 24-layer source')
    p.add_argument("--scheme", default="mesh", help="state scheme of the new model (default mesh)")
    p.add_argument("--core-init", choices=("average", "block"), default="average",
                   help="shared core = layer-wise mean of the blocks it replaces (default), or "
                        "one block as is")
    p.add_argument("--block", type=int, default=0,
                   help="with --core-init block: which block (0 = first, -1 = last)")
    p.add_argument("--router-start", choices=("fresh", "base"), default="base",
                   help="MeSH routers: biased to start as plain recursion, close to the source "
                        "(base, default), or meshlm's near-uniform init (fresh)")
    p.add_argument("--scheme-options", default="{}", help='JSON, e.g. \'{"slots": 6}\'')
    p.add_argument("--seed", type=int, default=0, help="seed for the scheme parameters' init")


def run(args: argparse.Namespace) -> int:
    from meshlm.errors import Problems
    from meshlm.folders import hub
    from meshlm.interop.retrofit import retrofit_folder

    p = Problems()
    p.need(hub.exists(args.source), f"source {args.source} does not exist; pass a GPT-NeoX, Llama "
                                    "or OLMoE folder, a vanilla meshlm checkpoint or a Hugging "
                                    "Face Hub name org/name[@revision]")
    options = p.check(_json, args.scheme_options)
    p.raise_if_any()
    out = retrofit_folder(args.source, args.out, args.spec, args.overwrite, scheme=args.scheme,
                          core_init=args.core_init,
                          block_index=args.block, router_start=args.router_start,
                          scheme_options=options,
                          seed=args.seed)
    print(f"wrote {out}: spec {args.spec}, scheme {args.scheme}, core init {args.core_init}")
    return 0


def _json(text: str) -> dict:
    from meshlm.errors import ConfigError

    try:
        options = json.loads(text)
    except ValueError:
        raise ConfigError("--scheme-options "
                          f"{text!r} is not JSON; e.g. '{{\"slots\": 6}}'") from None
    if not isinstance(options, dict):
        raise ConfigError(f"--scheme-options {text!r} must be a JSON object, e.g. '{{\"slots\": "
                          f"6}}'")
    return options
