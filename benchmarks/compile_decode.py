"""torch.compile for decoding: what compiling every layer costs on the first generation and saves
per token, and the break-even in generations (the decode-side companion of
benchmarks/compile_speed.py).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/compile_decode.py --threads 1
        # d=128, 2+2R4+2, 256 tokens

Two copies of one model (same weights): eager, and every layer compiled as training compiles it
(meshlm.train.parallel.compile_layers). Greedy generation of --new-tokens from a --prompt-token
prompt, batch 1. overhead = compiled first generation − eager first generation (a cold Inductor
cache: a user's first run); steady = medians of interleaved rounds; break-even = overhead / (eager −
compiled) generations. The tokens of both are compared (they must be equal). Dynamo guards on each
layer's cache slot, so a looped core with more unrolled slots than torch._dynamo's recompile limit
(8) runs its later slots eagerly.
"""
from __future__ import annotations

import argparse
import copy
import os
import tempfile

# cold cache
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="meshlm-inductor-"))

import torch  # noqa: E402
from benchkit import add_shape_arguments, add_timing_arguments, interleaved_medians, timing_setup  # noqa: E402


def main() -> None:
    from meshlm.config import ModelConfig
    from meshlm.generate import Sampling, generate
    from meshlm.model import MeshLM
    from meshlm.train.parallel import compile_layers

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_arguments(p)
    p.set_defaults(spec="2+2R4+2", d_model=128, heads=4)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256)
    add_timing_arguments(p, rounds=3)
    args = p.parse_args()
    clock = timing_setup(args)
    torch.manual_seed(0)
    cfg = ModelConfig(spec=args.spec, d_model=args.d_model, n_heads=args.heads,
                      vocab_size=args.vocab,
                      context_length=args.prompt + args.new_tokens, scheme="mesh")
    models = {"eager": MeshLM(cfg).eval()}
    models["compiled"] = copy.deepcopy(models["eager"])
    compile_layers(models["compiled"])
    s = Sampling(max_new_tokens=args.new_tokens, temperature=0, stop_at_eos=False)
    prompt = [list(range(5, 5 + args.prompt))]
    first, tokens = {}, {}
    for name, model in models.items():
        start = clock()
        with torch.no_grad():
            tokens[name] = generate(model, prompt, s)
        first[name] = clock() - start

    def step(model):
        def run():
            with torch.no_grad():
                generate(model, prompt, s)
        return run

    t = interleaved_medians({name: step(m) for name, m in models.items()}, args.rounds, clock)
    overhead, saved = first["compiled"] - first["eager"], t["eager"] - t["compiled"]
    print(f"spec {args.spec}, d_model {args.d_model}, {args.new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads, {args.clock} clock, {args.rounds} rounds; same "
          f"tokens: {tokens['eager'] == tokens['compiled']}")
    print(f"first generation: eager {first['eager']:.2f} s, compiled {first['compiled']:.2f} s "
          f"(compile overhead {overhead:.1f} s)")
    print(f"steady: eager {t['eager']:.2f} s, compiled {t['compiled']:.2f} s: "
          f"compiled {t['eager'] / t['compiled']:.2f}x")
    print(f"break-even: {overhead / saved:.0f} generations" if saved > 0
          else "break-even: never (no saving)")


if __name__ == "__main__":
    main()
