"""`meshlm finetune RUN_OR_FOLDER DATA`: supervised fine-tuning of any model folder meshlm opens (a
run, a checkpoint, a `meshlm retrofit` or `convert` output, a Hugging Face folder) on a JSONL of
{prompt, completion} or chat {messages}, with the loss on completions and assistant turns only
(meshlm.data.sft).

    meshlm finetune runs/mesh-small-mesh chat.jsonl
        # LoRA r=8 on attention + MLP
    meshlm finetune runs/base qa.jsonl train.lora_rank=0                     # full fine-tuning
    meshlm finetune retro/ qa.jsonl train.lora_rank=0 model.loop_lora_rank=8
    train.trainable=loop_lora meshlm finetune runs/base qa.jsonl train.lora_targets=core,attention
    --chat-template tmpl.jinja

It is `meshlm train` with train.init_from = RUN_OR_FOLDER, train.data = DATA prepared once into the
cache (with the folder's tokenizer and chat template), and fine-tuning defaults (FINETUNE_DEFAULTS)
that any KEY=VALUE override replaces. A LoRA run also writes `<run>/merged`: a meshlm checkpoint
with the adapters merged into the base weights (`meshlm convert <run>/merged OUT --to hf` exports it
for transformers).

The run folder (<out_dir>/<name>, default runs/<source's run>-ft) must be new, empty or a meshlm
run's own (then train's rules apply: --resume continues it; a fresh start refuses its checkpoints),
and never the source's: a folder of other files is refused before anything is prepared
(meshlm.outputs.claim_run). So is a train.lora_rank as wide as the layers it adapts
(meshlm.adapters.rank_problem, checked by meshlm.train.plan).
"""
from __future__ import annotations

import argparse
from pathlib import Path

FINETUNE_DEFAULTS = ("train.lora_rank=8", "train.lr=1e-3", "train.steps=200", "train.warmup=0.05",
                     "train.eval_every=50", "train.save_every=100")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="RUN_OR_FOLDER",
                   help="the model to fine-tune: any folder meshlm opens")
    p.add_argument("data", metavar="DATA",
                   help="JSONL of {prompt, completion} or {messages} records")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted overrides after the fine-tuning defaults, e.g. train.lora_rank=16 "
                        "train.steps=500")
    p.add_argument("--config", help="YAML config with `train:` (and `model:` overrides) sections")
    p.add_argument("--chat-template",
                   help="a Jinja chat template file (default: the folder's own, else meshlm's "
                       "documented default, meshlm.data.sft.DEFAULT_TEMPLATE)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run from its newest good checkpoint")


def run(args: argparse.Namespace) -> int:
    from meshlm import atomic, checkpoint, outputs
    from meshlm.commands.train import log_to_stderr
    from meshlm.data.sft import DEFAULT_TEMPLATE, cached_sft_data
    from meshlm.data.tokenizer import TEMPLATE_FILE
    from meshlm.folders.locate import locate
    from meshlm.loading import open_model
    from meshlm.train.config import load_config
    from meshlm.train.plan import resolve
    from meshlm.train.trainer import train

    folder = locate(args.source)
    name = [f"train.name={folder.run_dir.resolve().name}-ft"]  # a step folder: its run's name
    cfg = load_config(args.config, [*FINETUNE_DEFAULTS, *name, f"train.init_from={args.source}",
                                    *args.overrides])
    plan = resolve(cfg)  # the folder's model and tokenizer, which the data are prepared with
    outputs.claim_run(plan.run_dir, [args.source, folder.path])  # before the data are prepared
    own = chat_template(args, folder)  # None: meshlm's default
    data = cached_sft_data(args.data, plan.tokenizer, own, plan.model.context_length)
    template = own or DEFAULT_TEMPLATE
    recorded = ((TEMPLATE_FILE, template),)  # serve and a later finetune read the run's template
    result = train(plan.with_data(data, recorded), resume=args.resume, log=log_to_stderr)
    print(f"fine-tuned {result.steps} steps: validation loss {result.val_loss:.4f} on the "
          f"completion tokens")
    print(f"checkpoint: {result.checkpoint}")
    if cfg.lora_rank and result.checkpoint is not None:
        opened = open_model(result.checkpoint)
        source = {"format": "meshlm", "path": str(result.checkpoint), "merged": "lora"}
        merged = checkpoint.save_model(opened.model, plan.run_dir / "merged", {"source": source},
                                       opened.tokenizer_file)
        atomic.write_text(merged / TEMPLATE_FILE, template)
        print(f"merged: {merged} (LoRA folded into the base weights)")
    return 0


def chat_template(args: argparse.Namespace, folder) -> str | None:
    """--chat-template's file, else the model's own template (meshlm.folders.locate.ModelFolder's;
    None: meshlm's default)."""
    from meshlm.errors import ConfigError

    if not args.chat_template:
        return folder.chat_template
    path = Path(args.chat_template)
    if not path.is_file():
        raise ConfigError(f"--chat-template {path} does not exist; pass a Jinja template file")
    return path.read_text(encoding="utf-8")
