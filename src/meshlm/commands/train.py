"""`meshlm train`: train a model from a YAML config plus dotted overrides; with no arguments, the
default small MeSH model on the embedded corpus (a few minutes on a laptop CPU).

    meshlm train                                         # the default job
    meshlm train --config cpu/small-anchor.yaml model.d_model=128 train.lr=1e-3   # a shipped config
    meshlm train --config configs/paper/160m-2+4R2+2-mesh.yaml --resume
        # the same, by its repo path
    torchrun --nproc_per_node=8 -m meshlm.cli train --config ... train.distributed=fsdp
"""
from __future__ import annotations

import argparse
import os
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    overrides = p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                               help="dotted overrides applied after the config file, e.g. "
                                    "model.d_model=128 "
                                    "train.lr=1e-3 (every field is listed below)")
    overrides.completer = complete_override  # argcomplete (shell completion)
    p.formatter_class = argparse.RawDescriptionHelpFormatter  # the field list keeps its layout
    p.epilog_factory = fields_help
    p.add_argument("--config", help="YAML config with `model:` and `train:` sections: a path, or "
                                    "a shipped config such as cpu/small-mesh.yaml or "
                                    "paper/410m-4+8R2+4-mesh.yaml")
    p.add_argument("--resume", action="store_true",
                   help="continue the run from its newest good checkpoint (start fresh if it has "
                        "none)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config as YAML and exit: the model with every field "
                        "its preset (or init_from) and the overrides give, and every train field")


def fields_help() -> str:
    """Every model and train field with its type, default and meaning (from the dataclasses
    themselves)."""
    from meshlm.config import PRESETS, ModelConfig
    from meshlm.fielddocs import describe
    from meshlm.train.config import TrainConfig

    model = describe(ModelConfig,
                     f"model fields (model.KEY=VALUE; `model:` in a config file), on top of "
                     f"model.preset, one of: {', '.join(PRESETS)}:")
    train = describe(TrainConfig,
                     "train fields (train.KEY=VALUE or KEY=VALUE; `train:` in a config file):")
    return f"{model}\n\n{train}"


def complete_override(prefix: str, **_) -> list[str]:
    """model.FIELD= and train.FIELD= (and model.preset=NAME) for the shell."""
    from dataclasses import fields

    from meshlm.config import PRESETS, ModelConfig
    from meshlm.train.config import TrainConfig

    names = [f"model.{f.name}=" for f in fields(ModelConfig)] + [f"model.preset={name}"
                                                                 for name in PRESETS]
    names += [f"train.{f.name}=" for f in fields(TrainConfig) if f.name != "model"]
    return [n for n in names if n.startswith(prefix)]


def run(args: argparse.Namespace) -> int:
    """The config (file + overrides) -> the resolved run (meshlm.train.plan) -> the trainer."""
    import yaml

    from meshlm.errors import Interrupted
    from meshlm.train.config import load_config
    from meshlm.train.plan import resolve, resolve_model

    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(yaml.safe_dump(resolved(cfg, resolve_model(cfg)[0]), sort_keys=False), end="")
        return 0
    from meshlm.train.trainer import train

    plan = resolve(cfg)
    try:
        result = train(plan, resume=args.resume, log=log_to_stderr)
    except Interrupted as err:
        err.args = (str(err).replace("the same command and --resume", resume_command(args)),)
        raise
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun only rank 0 reports
        return 0
    if result.start_step >= result.steps:  # --resume of a finished run: nothing was trained now
        print(f"already trained: {result.steps} steps (resumed at its last step)")
    else:
        print(f"trained {result.steps} steps in {result.wall_s:.0f} s ({result.tokens_per_s:,.0f} "
              f"tokens/s, MFU {100 * result.mfu:.1f}%)")
    print(f"validation perplexity {result.val_ppl:.2f} (loss {result.val_loss:.4f}); "
          f"unigram baseline {_unigram(result, plan.model.vocab_size):.2f}")
    print(f"checkpoint: {result.checkpoint}")
    return 0


def log_to_stderr(message: str) -> None:
    """The trainer's log lines go to stderr, so stdout holds only the results."""
    print(message, file=sys.stderr, flush=True)


def resolved(cfg, model_cfg) -> dict:
    """The config file that trains exactly this: the model section expanded to every ModelConfig
    field (`model_cfg`, the model `cfg` resolves to)."""
    data = cfg.to_file_dict()
    preset = {"preset": data["model"]["preset"]} if "preset" in data["model"] else {}
    data["model"] = {**preset, **model_cfg.to_dict()}
    return data


def resume_command(args: argparse.Namespace) -> str:
    """The command line that continues this run."""
    import shlex

    config = ["--config", args.config] if args.config else []
    return shlex.join(["meshlm", "train", *config, *args.overrides, "--resume"])


def _unigram(result, vocab_size: int) -> float:
    from meshlm.data.prepare import PreparedData
    from meshlm.train.baseline import unigram_perplexity

    train_data = PreparedData(result.data_dir, "train")
    return unigram_perplexity(train_data, PreparedData(result.data_dir, "val"), vocab_size)
