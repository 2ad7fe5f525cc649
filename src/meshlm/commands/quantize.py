"""`meshlm quantize RUN --bits 8|4 [--activations int8|bf16]`: an int8 (per channel) or int4
(grouped) checkpoint of RUN; int8 weights meet int8-rounded activation rows unless `--activations
bf16` asks for weight-only, int4 weights bf16 ones unless `--activations int8` asks for w4a8.

Calibrates on windows of the training split (every loop visit of a shared layer counted), quantizes
the chosen parts (default: the looped cores; prelude, coda, head and routers stay fp32), prints and
stores the per-loop error report (state distance after each loop step, held-out loss at each loop
count), and writes a verified meshlm checkpoint (default RUN/w8a8, RUN/int8 or RUN/int4) that
`meshlm generate`, `eval` and `serve` open as any other. --out must be new or empty, or an earlier
quantize output replaced with --overwrite; never the run itself (meshlm.outputs). See meshlm.quant
and docs/quantize.md.
"""
from __future__ import annotations

import argparse

# meshlm.quant's PARTS, DEFAULT_PARTS, GROUP_SIZES and ACTIVATIONS, spelled out: the parser is built
# before torch may load (meshlm.cli tunes malloc first); tests/test_quant.py checks they agree
PARTS, DEFAULT_PARTS, GROUP_SIZES = ("prelude", "cores", "coda", "head",
                                     "routers"), ("cores",), (32, 64, 128, 256)
ACTIVATIONS = ("bf16", "int8")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a meshlm run or checkpoint folder")
    p.add_argument("--bits", type=int, choices=(8, 4), required=True,
                   help="8: int8 per channel; 4: int4 grouped")
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=64,
                   help="int4 group (default 64)")
    p.add_argument("--activations", choices=ACTIVATIONS, default=None,
                   help="int8 (the default with --bits 8): each activation row rounded to int8 "
                        "too, the fastest CPU kernels (with --bits 4: w4a8); bf16: weight-only "
                        "(the default with --bits 4) (docs/quantize.md)")
    p.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                   help=f"what to quantize, comma-separated from {','.join(PARTS)} (default "
                        f"{','.join(DEFAULT_PARTS)})")
    p.add_argument("--out", default=None,
                   help="output folder (default RUN/w8a8, RUN/int8 weight-only, or RUN/int4): new, "
                        "empty, or an earlier quantize output with --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier `meshlm quantize` output in --out (never other files)")
    p.add_argument("--data", default=None,
                   help="prepared data to calibrate and report on (default: the run's)")
    p.add_argument("--calibration", type=int, default=32,
                   help="training windows to calibrate on (default 32)")
    p.add_argument("--report-windows", type=int, default=32,
                   help="held-out windows the report uses (default 32)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="window length (default: the training seq_len)")
    p.add_argument("--no-report", action="store_true", help="skip the per-loop error report")
    p.hints = {"required": "pass --bits 8 or --bits 4, e.g. meshlm quantize runs/small-mesh "
                           "--bits 8"}


def run(args: argparse.Namespace) -> int:
    import torch

    from meshlm import outputs
    from meshlm.loading import open_model
    from meshlm.quant import default_activations, quantize_model

    args.activations = args.activations or default_activations(args.bits)
    parts, out = check_inputs(args)
    opened = open_model(args.checkpoint)
    if opened.meta.get("quantization"):
        from meshlm.errors import ConfigError

        raise ConfigError(f"{opened.path} is quantized already; pass the full-precision checkpoint "
                          f"it came from ({opened.meta['quantization']['source']['path']})")
    check_group_size(opened.model, args, parts)
    seq_len = args.seq_len or opened.seq_len
    train = opened.held_out(args.data, split="train")
    batches = windows(train, args.calibration, seq_len)
    print(f"calibrating {opened.path} "
          f"on {sum(len(b) for b in batches)} windows of {seq_len} tokens", flush=True)
    with torch.no_grad():
        quantized, spec = quantize_model(opened.model, args.bits, parts, args.group_size, batches,
                                         args.activations)
        if not args.no_report:
            spec["report"] = error_report(opened, quantized, args, seq_len)
    write(opened, quantized, spec, out)
    outputs.mark(out, "quantize")
    kind = (f"int{args.bits} weights and int8 activations" if args.activations == "int8" else
            "int8 weight-only" if args.bits == 8 else "int4")
    print(f"wrote {out}: {kind} {', '.join(spec['parts'])} ({len(spec['layers'])} layers), "
          f"{megabytes(quantized):.1f} MB of weights (full precision {megabytes(opened.model):.1f} "
          "MB)")
    return 0


def check_inputs(args: argparse.Namespace):
    from pathlib import Path

    from meshlm import outputs
    from meshlm.errors import Problems

    p = Problems()
    parts = tuple(x for x in args.parts.split(",") if x)
    unknown = sorted(set(parts) - set(PARTS))
    p.need(bool(parts) and not unknown,
           f"--parts {args.parts!r}: unknown {unknown or 'empty'}; choose from "
           f"{','.join(PARTS)}, e.g. --parts cores")
    p.need(args.calibration >= 1, f"--calibration {args.calibration} must be >= 1 window")
    p.need(args.report_windows >= 1, f"--report-windows {args.report_windows} must be >= 1 window")
    p.need(Path(args.checkpoint).is_dir(),
           f"{args.checkpoint} is not a folder; pass a meshlm run or checkpoint")
    name = f"w{args.bits}a8" if args.activations == "int8" else f"int{args.bits}"
    out = Path(args.out) if args.out else Path(args.checkpoint) / name
    # write_checkpoint replaces the whole folder: never a run's, a user's, or the source itself
    if p.check(outputs.claim, out, "quantize", args.overwrite, [args.checkpoint]):
        p.writable(out, "--out")
    p.raise_if_any()
    return parts, out


def check_group_size(model, args: argparse.Namespace, parts: tuple[str, ...]) -> None:
    """int4 groups must tile every quantized layer's input: else a one-line error naming a group
    size that does (or --bits 8)."""
    from meshlm.errors import ConfigError
    from meshlm.quant.calibrate import targets

    if args.bits != 4:
        return
    widths = {name: m.in_features for name, m in targets(model, set(parts)).items()}
    ragged = [name for name, width in widths.items() if width % args.group_size]
    if ragged:
        fits = [g for g in GROUP_SIZES if all(width % g == 0 for width in widths.values())]
        fix = f"--group-size {max(fits)}" if fits else "--bits 8"
        raise ConfigError(f"--group-size {args.group_size} does not divide the input width of "
                          f"{ragged[0]} ({widths[ragged[0]]}"
                          f"{f', and {len(ragged) - 1} more layers' if len(ragged) > 1 else ''}); "
                          f"pass {fix}")


def windows(data, count: int, seq_len: int, batch_size: int = 8):
    """`count` windows spread over the split, as (≤ batch_size, seq_len) id batches."""
    import torch

    from meshlm.evaluation.perplexity import window_indices

    indices = window_indices(data.num_sequences(seq_len), count)
    ids = torch.from_numpy(data.inputs_targets(indices, seq_len)[0])
    return list(ids.split(batch_size))


def error_report(opened, quantized, args: argparse.Namespace, seq_len: int) -> dict:
    from meshlm.quant.report import format_report, loss_by_loops, state_distances

    val = opened.held_out(args.data)
    report = {**state_distances(opened.model, quantized,
                                windows(val, args.report_windows, seq_len)),
              "loss": loss_by_loops(opened.model, quantized, val, seq_len, args.report_windows),
              "windows": args.report_windows, "seq_len": seq_len}
    print(format_report(report), flush=True)
    return report


def write(opened, quantized, spec: dict, out) -> None:
    from meshlm.checkpoint import write_checkpoint

    source = {"path": str(opened.path), "step": opened.meta.get("step")}
    # write_checkpoint names the carried one
    meta = {k: v for k, v in opened.meta.items() if k != "tokenizer"}
    meta["quantization"] = {**spec, "source": source}
    write_checkpoint(out, quantized.state_dict(), meta, tokenizer=opened.tokenizer_file)


def megabytes(model) -> float:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 1e6
