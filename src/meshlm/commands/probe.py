"""`meshlm probe CKPT`: the paper's hidden-state probes and MeSH router behaviour on held-out
sequences.

    meshlm probe runs/mesh-small-mesh                    # 100 validation windows -> <run>/probe/
    meshlm probe runs/small-base --samples 500 --tokens 128 --save-states

Writes probe.json (mean, std and per-sample values of every measure; see meshlm.analysis.probes) and
the PNG figures of meshlm.analysis.plots next to it.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from meshlm.errors import ConfigError
from meshlm.runtime.options import add_dtype_argument, add_tokenizer_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CKPT",
                   help="a run folder (its latest checkpoint), a step-NNNNNN folder, a converted "
                        "or retrofitted folder, or a Hugging Face folder (meshlm.loading)")
    add_tokenizer_arguments(p)
    p.add_argument("--samples", type=int, default=100,
                   help="held-out sequences to probe (default 100)")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per sequence (default: the training length)")
    p.add_argument("--data", help="prepared-data folder (default: what the model was trained on)")
    p.add_argument("--split", default="val", help="split of the prepared data (default val)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward (default 8)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    add_dtype_argument(p)
    p.add_argument("--out", help="output folder (default: <run>/probe): new, empty, or an earlier "
                                 "probe output with --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier `meshlm probe` output in --out (never other files)")
    p.add_argument("--save-states", action="store_true",
                   help="also write every sample's stage matrices to states.safetensors (N, "
                        "stages, T, d)")


def held_out_samples(data, n: int, tokens: int):
    """`n` windows of `tokens` input tokens spread evenly over the split: (n', tokens) ids, n' <=
    n."""
    import numpy as np
    import torch

    from meshlm.evaluation.perplexity import window_indices

    indices = window_indices(data.num_sequences(tokens), n)
    return torch.from_numpy(np.stack([data.sequence(i, tokens)[:-1] for i in indices]))


def run(args: argparse.Namespace) -> int:
    import torch

    from meshlm import outputs
    from meshlm.folders import hub

    # first: importing meshlm.evaluation switches the Hub off (for lm-eval's data)
    hub.prefetch(args.checkpoint)
    from meshlm.analysis import plots
    from meshlm.analysis.probes import probe
    from meshlm.evaluation.results import ProbeResult, write
    from meshlm.loading import open_model
    from meshlm.runtime import precision

    check_inputs(args)
    loaded = open_model(args.checkpoint, args.device, tokenizer=args.tokenizer,
                        force_tokenizer=args.force_tokenizer)
    tokens = args.tokens or loaded.seq_len
    if tokens > loaded.model.config.context_length:
        raise ConfigError(f"--tokens {tokens} exceeds the model's context_length "
                          f"{loaded.model.config.context_length}; pass a smaller --tokens")
    samples = held_out_samples(loaded.held_out(args.data, args.split), args.samples, tokens)
    if len(samples) < args.samples:
        print(f"note: the {args.split} split holds only {len(samples)} windows of {tokens} tokens; "
              "probing those")
    states = [] if args.save_states else None
    device, chosen = precision.for_model(args.dtype, loaded.model)
    print(f"probing {loaded.path} in {chosen.describe()}", flush=True)
    with precision.autocast(device, chosen):
        measures = probe(loaded.model, samples, args.batch_size, states)
    result = ProbeResult.from_dict({
        "checkpoint": str(loaded.path), "step": loaded.meta.get("step"),
        "label": loaded.run_dir.name, "model": loaded.model.config.to_dict(), "dtype": chosen.name,
        **measures})
    out = Path(args.out) if args.out else loaded.run_dir / "probe"
    write(result, out / "probe.json")
    paths = plots.save(plots.probe_figures([(result.label, result)]), out)
    if states is not None:
        from safetensors.torch import save_file

        from meshlm import atomic

        atomic.write_with(out / "states.safetensors", lambda tmp: save_file(
            {"states": torch.stack(states)}, str(tmp),
            metadata={"stages": ",".join(result.stages)}))
    outputs.mark(out, "probe")
    print(summary(result))
    print(f"results: {out / 'probe.json'}; figures: {', '.join(p.name for p in paths)}")
    return 0


def check_inputs(args: argparse.Namespace) -> None:
    """Numbers, device, checkpoint and --data, all before loading anything (every problem in one
    error)."""
    from meshlm import outputs
    from meshlm.errors import Problems
    from meshlm.folders import hub
    from meshlm.folders.locate import locate
    from meshlm.runtime.devices import resolve_device

    p = Problems()
    p.need(args.samples >= 1 and args.batch_size >= 1, "--samples and --batch-size must be >= 1")
    p.need(args.tokens is None or args.tokens >= 2, f"--tokens {args.tokens} must be >= 2")
    p.need(args.split in ("train", "val"), f"--split {args.split!r} must be train or val")
    p.check(resolve_device, args.device)
    if p.need(hub.exists(args.checkpoint), f"{args.checkpoint} does not exist; pass a run folder, "
                                           "a step-NNNNNN folder or a Hugging Face Hub name "
                                           "org/name[@revision]"):
        folder = p.check(locate, args.checkpoint)
        out = (args.out or folder.run_dir / "probe") if folder is not None else None
        # before any compute: never a folder of other files, nor the model's own
        if out is not None and p.check(outputs.claim, out, "probe", args.overwrite,
                                       [args.checkpoint, folder.path], "output folder"):
            p.writable(out, "output folder")
        if folder is not None and args.tokenizer:
            p.check(folder.chosen_tokenizer, args.tokenizer, args.force_tokenizer)
    if args.data is not None:
        p.need(Path(args.data).expanduser().is_dir(),
               f"--data {args.data} does not exist; pass a folder written by `meshlm prepare`")
    p.raise_if_any()


def _fmt(values: list[float]) -> str:
    return " ".join(f"{v:.3f}" for v in values)


def summary(r) -> str:
    """A few lines of the headline numbers (means over samples) of a ProbeResult."""
    fmt, n = _fmt, len(r.stages)
    steps = [r.cka_rbf.mean[i][i + 1] for i in range(n - 1)]
    blocks, ranks = " ".join(r.blocks), " ".join(f"{v:.1f}" for v in r.effective_rank.mean)
    lines = [f"probed {r.samples} x {r.tokens} tokens; stages {' '.join(r.stages)}",
             f"  relative update h->f(h)     [{blocks}]: {fmt(r.update_core.mean)}",
             f"  relative update h^t->h^t+1  [{blocks}]: {fmt(r.update_state.mean)}",
             f"  CKA(rbf) consecutive stages: {fmt(steps)}",
             f"  effective rank per stage:    {ranks}"]
    if r.read_entropy is not None:
        lines.append(f"  read entropy per pair:       {fmt(r.read_entropy.mean)} "
                     f"(uniform {r.max_entropy:.3f})")
    return "\n".join(lines)
