"""Relaxed recursion on a retrofit (Bae et al. 2024, arXiv 2410.20672, at CPU scale): a vanilla
Llama-shaped model trained on the embedded corpus is retrofitted to a looped one (its middle blocks
replaced by one shared block run twice), which costs loss; each variant then trains on the same
tokens to recover it:

    full          every parameter (scheme base)
    shared-lora   PEFT LoRA rank R on the shared core's Linears, everything else frozen (scheme
                  base)
    loop-lora     per-loop LoRA rank R/2 per pass on the same Linears (2 passes: the same trainable
                  count), everything else frozen (scheme base)
    mesh-routers  MeSH routers only (scheme mesh, routers started as plain recursion), everything
                  else frozen

    .venv/bin/python scripts/retrofit_finetune_study.py --out study-ft
        # ~20 min on 2 CPU cores
    .venv/bin/python scripts/retrofit_finetune_study.py --out study-ft --report  # the table again

Prints, per variant and seed: trainable parameters, validation loss at the start and every eval, and
the share of the retrofit's loss gap (retrofit − vanilla) recovered by the end. Figures go to
docs/finetune.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

COMMON = dict(seq_len=128, global_batch=8, micro_batch=8, eval_windows=64, progress=False,
              tensorboard=False)


def variants(rank: int) -> dict[str, tuple[str, dict]]:
    """name -> (retrofit scheme, train overrides)."""
    return {
        "full": ("base", dict(lr=1e-3)),
        "shared-lora": ("base", dict(lr=1e-2, lora_rank=rank, lora_targets="core")),
        "loop-lora": ("base", dict(lr=1e-2, model={"loop_lora_rank": rank // 2,
                                                   "loop_lora_alpha": float(rank)},
                                   trainable="loop_lora")),
        # at 1e-2 the routers left plain recursion
        "mesh-routers": ("mesh", dict(lr=1e-3, trainable="routers")),
    }


def run_all(args) -> None:
    from meshlm.cli import main as meshlm
    from meshlm.train.config import TrainConfig
    from meshlm.train.trainer import train

    out = Path(args.out)
    vanilla = out / "vanilla"
    if not (vanilla / "latest").is_file():
        train(TrainConfig(**COMMON, model={"preset": "llama-small"}, out_dir=str(out),
                          name="vanilla",
                          steps=args.pretrain_steps, eval_every=0, save_every=0))
    for scheme in ("base", "mesh"):
        if not (out / f"retro-{scheme}" / "config.json").is_file():
            assert (meshlm(["retrofit", str(vanilla), str(out / f"retro-{scheme}"), "--spec",
                            "2+2R2+2",
                            "--scheme", scheme, "--core-init", "block", "--block", "0"]) == 0)
    for name, (scheme, overrides) in variants(args.rank).items():
        for seed in range(args.seeds):
            run = out / f"{name}-s{seed}"
            if (run / "latest").is_file():
                continue
            train(TrainConfig(**{**COMMON, **overrides, "init_from": str(out / f"retro-{scheme}"),
                                 "seed": seed,
                                 "out_dir": str(out), "name": run.name, "steps": args.steps,
                                 "warmup": 0.05,
                                 "eval_every": args.steps // 6, "save_every": 0}))


def evals(run: Path) -> list[tuple[int, float, int]]:
    """(step, val loss, tokens) of every eval record."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["val_loss"], r["tokens"]) for r in rows if r["kind"] == "eval"]


def start_loss(folder: Path, data_dir: Path) -> float:
    """Validation loss of a model folder on the windows training validates on (Trainer.evaluate's
    set)."""
    import torch

    from meshlm.data.order import validation_batches
    from meshlm.data.prepare import PreparedData
    from meshlm.loading import open_model
    from meshlm.train.batches import windows_xy

    model, data = open_model(folder).model, PreparedData(data_dir, "val")
    total, count = 0.0, 0
    with torch.no_grad():
        for indices, _ in validation_batches(data.num_sequences(COMMON["seq_len"]),
                                             COMMON["eval_windows"], 8):
            x, y = windows_xy(data, indices, COMMON["seq_len"])
            total += model(x, y).loss.item() * y.numel()
            count += y.numel()
    return total / count


def report(args) -> None:
    from meshlm.data.prepare import prepare_default

    # the embedded corpus every run trained on
    out, data = Path(args.out), prepare_default(progress=False)
    vanilla = start_loss(out / "vanilla", data)
    starts = {s: start_loss(out / f"retro-{s}", data) for s in ("base", "mesh")}
    print(f"vanilla (8 layers) val loss {vanilla:.4f}; retrofit 2+2R2+2 at step 0: base "
          f"{starts['base']:.4f}, mesh {starts['mesh']:.4f}")
    for name, (scheme, _) in variants(args.rank).items():
        runs = sorted(out.glob(f"{name}-s*"))
        if not runs:
            continue
        trainable = json.loads((runs[0]
                                / "metrics.jsonl").read_text().splitlines()[0])["trainable_params"]
        curves = [evals(r) for r in runs]
        final = [c[-1][1] for c in curves]
        gap = starts[scheme] - vanilla
        recovered = [(starts[scheme] - f) / gap for f in final]
        points = " ".join(f"{c[1]:.3f}" for c in curves[0])
        print(f"{name:>13}: trainable {trainable:>9,}  final val loss {statistics.mean(final):.4f} "
              f"(seeds {', '.join(f'{f:.4f}' for f in final)}), gap recovered "
              f"{100 * statistics.mean(recovered):.0f}% after {curves[0][-1][2]:,} tokens; seed 0 "
              f"curve at {[c[2] for c in curves[0]][0]:,}-token steps: {points}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="study-ft")
    p.add_argument("--pretrain-steps", type=int, default=600)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--report", action="store_true", help="only print the table of a finished study")
    args = p.parse_args()
    if not args.report:
        run_all(args)
    report(args)


if __name__ == "__main__":
    main()
