"""`meshlm convert SRC OUT`: GPT-NeoX (Pythia) / Llama / OLMoE folder <-> meshlm checkpoint, and
meshlm -> Hugging Face folder.

The source format is recognised from its config.json. Defaults: a GPT-NeoX, Llama, OLMoE or
meshlm-HF folder becomes a meshlm checkpoint; a meshlm checkpoint becomes a folder of its backbone's
family (vanilla models only) — use `--to hf` for a MeshForCausalLM folder that transformers and
lm-eval load (any scheme, any backbone). Logits are preserved exactly.
"""
from __future__ import annotations

import argparse

from meshlm.interop import FORMATS
from meshlm.runtime.options import add_tokenizer_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source",
                   help="GPT-NeoX, Llama or OLMoE folder, meshlm checkpoint/run dir, or meshlm "
                        "Hugging Face folder")
    p.add_argument("out", help="output folder: new, empty, or an earlier convert output with "
                               "--overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier `meshlm convert` output in OUT (never other files)")
    p.add_argument("--to", choices=FORMATS, default=None,
                   help="target format (default: meshlm from a family or hf folder; from meshlm, "
                        "the family of the model's backbone)")
    add_tokenizer_arguments(p, "the source's, by meshlm.loading's rule; carried into the output")


def run(args: argparse.Namespace) -> int:
    from meshlm.errors import ConfigError
    from meshlm.folders import hub
    from meshlm.folders.locate import locate
    from meshlm.interop.convert import convert

    if not hub.exists(args.source):
        raise ConfigError(f"source {args.source} does not exist; pass a model folder, a meshlm "
                          "run/checkpoint or a Hugging Face Hub name org/name[@revision]")
    out = convert(args.source, args.out, args.to, args.tokenizer, args.force_tokenizer,
                  args.overwrite)
    print(f"wrote {out} ({locate(out).format} format)")
    return 0
