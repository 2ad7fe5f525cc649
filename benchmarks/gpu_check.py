"""One short, prepared training run on one CUDA GPU: the Pythia-160M-shaped `2+4R2+2` MeSH model on
the embedded corpus, through the real trainer, exercising bf16 autocast, SDPA's flash kernel,
torch.compile and NCCL (a one-rank process group with the model wrapped in DDP, so every step's
gradients go through an NCCL all-reduce). Prints and writes (to --out/gpu_check.json) tokens/s, MFU
and the loss after N steps.

    PYTHONPATH=src python3 benchmarks/gpu_check.py --steps 60 --out /tmp/gpu-check
        # on a GPU machine
    PYTHONPATH=src python3 benchmarks/gpu_check.py --device cpu --smoke --out /tmp/x
        # tiny CPU smoke run

Needs torch, numpy, tokenizers, safetensors, pyyaml and tqdm (not transformers, lm-eval or datasets,
and not an installed meshlm: `PYTHONPATH=src` is enough); no network. The model is built eager and
first runs `--eager-steps` steps; then every layer is compiled in place
(meshlm.train.parallel.compile_layers). The next `--warmup` steps (compile happens there) are timed
apart; tokens/s and MFU come from the `--steps` steps after them, and the eager steps give compile's
speed-up, overhead and break-even step count on this GPU. MFU divides by the bf16 peak of this GPU
measured by a large matmul (meshlm.runtime.peaks.measure_matmul_peak), and also by the datasheet
peak when the chip is known.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

SRC = Path(__file__).resolve().parent.parent / "src"
if str(SRC) not in sys.path:  # runs from a checkout without an installed meshlm
    sys.path.insert(0, str(SRC))

from meshlm.runtime.peaks import GPU_BF16_PEAKS, measure_matmul_peak  # noqa: E402
from meshlm.train import parallel  # noqa: E402
from meshlm.train.config import TrainConfig  # noqa: E402
from meshlm.train.plan import resolve  # noqa: E402
from meshlm.train.trainer import Trainer  # noqa: E402

PRESET = "pythia-160m-2+4R2+2"  # d 768, 12 heads, 2 prelude + 4-layer core × 2 + 2 coda, MeSH


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60,
                   help="timed optimizer steps (after the warm-up)")
    p.add_argument("--warmup", type=int, default=3,
                   help="steps timed apart first (torch.compile happens here)")
    p.add_argument("--eager-steps", type=int, default=20,
                   help="steps timed eagerly before compiling, for compile's speed-up and "
                        "break-even")
    p.add_argument("--out", required=True, help="folder for gpu_check.json")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step")
    p.add_argument("--micro-batch", type=int, default=8,
                   help="sequences per forward (2 micro-batches: no_sync)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (to compare)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model and shapes (a CPU test of this script)")
    p.add_argument("--data", default="default", help="prepared data (default: the embedded corpus)")
    return p.parse_args(argv)


def init_process_group(device: str) -> str:
    """A one-rank process group (NCCL on CUDA, gloo on CPU) on a free local port; returns the
    backend."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if device == "cuda" else "gloo"
    kwargs = {"device_id": torch.device("cuda", 0)} if device == "cuda" else {}
    dist.init_process_group(backend, rank=0, world_size=1, **kwargs)
    return backend


def train_config(args: argparse.Namespace, out_dir: str) -> TrainConfig:
    smoke = dict(preset="tiny", vocab_size=8192) if args.smoke else dict(preset=PRESET)
    seq_len = 32 if args.smoke else args.seq_len
    global_batch, micro_batch = (2, 1) if args.smoke else (args.global_batch, args.micro_batch)
    return TrainConfig(name="gpu-check", out_dir=out_dir, model=smoke, data=args.data,
                       seq_len=seq_len,
                       global_batch=global_batch, micro_batch=micro_batch,
                       steps=args.warmup + args.steps,
                       lr=6e-4, warmup=0.1, eval_every=0, save_every=0,
                       eval_windows=2 * micro_batch,
                       progress=False, tensorboard=False, device=args.device, dtype="auto",
                       compile="false")


def check_flash(trainer: Trainer) -> bool:
    """One eager bf16 forward with SDPA restricted to the flash kernel: raises if the model's
    attention cannot take that path (an explicit mask, an unsupported head size or dtype)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x = torch.randint(0, 1000, (1, 256), device=trainer.env.device)
    with torch.no_grad(), sdpa_kernel([SDPBackend.FLASH_ATTENTION]), parallel.autocast(trainer.env):
        trainer.model(x, x)
    return True


def flash_kernels_in_step(trainer: Trainer, step: int) -> list[str]:
    """Names of the GPU kernels of one (compiled) training step that are flash-attention kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        trainer.train_step(step)
        torch.cuda.synchronize()
    return sorted({e.key for e in prof.key_averages() if "flash" in e.key.lower()})


def compile_gain(eager_s: float | None, warmup_s: list[float], step_s: float, tokens: int) -> dict:
    """Eager vs. compiled step time of this run, the compile overhead and the break-even step
    count."""
    if eager_s is None:
        return {}
    # the warm-up steps' time beyond compiled steps
    overhead = sum(warmup_s) - len(warmup_s) * step_s
    saved = eager_s - step_s
    return {"eager_tokens_per_s": round(tokens / eager_s, 1),
            "compile_speedup": round(eager_s / step_s, 3),
            "compile_overhead_s": round(overhead, 1),
            "compile_break_even_steps": round(overhead / saved) if saved > 0 else None}


def run(args: argparse.Namespace) -> dict:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device is visible; run with --device cpu --smoke to "
                         "test the script")
    backend = init_process_group(args.device)
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            return _run(args, backend, out_dir)
    finally:
        dist.destroy_process_group()


def _run(args: argparse.Namespace, backend: str, out_dir: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    # built eager: the layers are compiled below, after eager steps
    cfg = train_config(args, out_dir)
    plan = resolve(cfg)
    env = parallel.setup(plan)  # world 1 from the environment: the trainer itself adds no DDP
    cuda = env.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    trainer = Trainer(plan, env, log=lambda message: print(message, flush=True))
    setup_s = time.perf_counter() - t0
    flash = check_flash(trainer) if cuda else False
    trainer.wrapped = DistributedDataParallel(trainer.wrapped, device_ids=[0] if cuda else None)
    probe = torch.ones((), device=env.device)
    dist.all_reduce(probe)  # the collective itself, once, outside DDP too

    step, losses = 0, []

    def timed(n: int) -> float:
        """Run n optimizer steps; their wall time (synchronised)."""
        nonlocal step
        sync()
        start = time.perf_counter()
        for _ in range(n):
            losses.append(trainer.train_step(step)[0])
            step += 1
        sync()
        return time.perf_counter() - start

    eager_s = None
    if not args.no_compile:
        # this run's eager step time first: what compile gains, and its break-even
        if args.eager_steps:
            timed(1)  # warm-up (cuBLAS handles, the caching allocator)
            eager_s = timed(args.eager_steps) / args.eager_steps
        print("compiling every layer (torch.compile) for the timed steps", flush=True)
        # in place: DDP and the trainer call the compiled layers now
        parallel.compile_layers(trainer.model)
    warmup_s = [timed(1) for _ in range(args.warmup)]  # compile happens here
    timed_s = timed(args.steps)
    flash_kernels = flash_kernels_in_step(trainer, step) if cuda else []
    val_loss = trainer.evaluate()

    tokens_per_s = args.steps * trainer.tokens_per_step / timed_s
    achieved = tokens_per_s * trainer.flops_per_token
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak_dtype = env.autocast_dtype or torch.float32
    measured_peak = measure_matmul_peak(env.device, peak_dtype, n=8192 if cuda else 512)
    datasheet = (next((p for key, p in GPU_BF16_PEAKS.items() if key in name), None) if cuda
                 else None)
    m = trainer.model_cfg
    return {
        "device": name, "torch": torch.__version__, "backend": backend, "ddp": True,
        "model": {"preset": cfg.model["preset"], "spec": m.spec, "scheme": m.scheme,
                  "d_model": m.d_model,
                  "n_heads": m.n_heads, "vocab_size": m.vocab_size},
        "precision": "bf16 autocast" if env.autocast_dtype else "fp32",
        "compile": not args.no_compile,
        "sdpa_flash_eager_check": flash, "flash_kernels_in_compiled_step": flash_kernels,
        "seq_len": trainer.seq_len, "global_batch": cfg.global_batch,
        "micro_batch": cfg.micro_batch,
        "tokens_per_step": trainer.tokens_per_step,
        "train_flops_per_token": trainer.flops_per_token,
        "setup_s": round(setup_s, 2), "warmup_step_s": [round(s, 3) for s in warmup_s],
        "timed_steps": args.steps, "timed_s": round(timed_s, 3),
        "tokens_per_s": round(tokens_per_s, 1),
        **compile_gain(eager_s, warmup_s, timed_s / args.steps, trainer.tokens_per_step),
        "achieved_tflops": round(achieved / 1e12, 2),
        "peak_tflops_measured": round(measured_peak / 1e12, 2),
        "peak_method": f"best {str(peak_dtype).removeprefix('torch.')} {8192 if cuda else 512}^3 "
                       "matmul",
        "mfu_vs_measured_peak": round(achieved / measured_peak, 4),
        "peak_tflops_datasheet": datasheet and datasheet / 1e12,
        "mfu_vs_datasheet_peak": datasheet and round(achieved / datasheet, 4),
        "first_loss": round(losses[0], 4), "loss_after_n_steps": round(losses[-1], 4),
        "steps_total": step, "val_loss": round(val_loss, 4),
        "max_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    result = run(args)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['device']}: {result['model']['spec']} {result['model']['scheme']} "
          f"d={result['model']['d_model']}, {result['precision']}, compile={result['compile']}, "
          f"{result['backend']} DDP; {result['tokens_per_s']:,.0f} tokens/s, "
          f"{result['achieved_tflops']} TFLOP/s, MFU {100 * result['mfu_vs_measured_peak']:.1f}% "
          f"of the measured {result['peak_tflops_measured']} TFLOP/s peak; loss "
          f"{result['first_loss']} -> {result['loss_after_n_steps']} after {result['steps_total']} "
          f"steps (val {result['val_loss']}); {result['wall_s']} s in all")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
