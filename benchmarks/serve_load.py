"""Load on `meshlm serve` through the real async openai client: throughput, time to first token and
inter-token latency (p50, p99) at several concurrencies, for plain decoding, exit and speculation.

    .venv/bin/python benchmarks/serve_load.py RUN --exit state:1.0 --speculate auto --requests 32 \
        --tokens 32

The server runs in a subprocess on a free 127.0.0.1 port with one torch thread (`--server-threads`),
the client in this process. For every mode (plain; `exit`; `speculate`) and concurrency (1, 4, 16),
`--requests` streamed, greedy requests of `--tokens` tokens each (EOS ignored, so every request
makes exactly that many), prompts cut from the held-out corpus, at most `--concurrency` in flight.
With `--deep L`, a mode "plain + deep client" adds one adversarial client that keeps sending
`loops: L` requests (the depth a client may ask for, up to --max-loops) while the good ones run;
its requests are not counted, and the good ones' inter-token latency p99 against plain's is the
fairness ratio (`--loop-slice` is passed to the server: 0 turns slicing off). Each level also sends
`--bad` bad requests (an unknown field, a negative temperature: both must be
400) and `--disconnects` streams that hang up after two chunks; a good request that fails is counted
and printed. A level stops starting requests after `--seconds`. Every mode runs at every level once
per round, rounds alternating the order, and the figures are the medians over rounds. `--compile`
adds a mode: the same plain requests to a second server started with `--compile` (its warm-up
compile done before the first level). `--versus SRC` adds another: the same plain requests to a
server whose meshlm is imported from SRC/src (a git worktree of an earlier commit, say), so that
code versions are compared in the same rounds: the compiled (or plain) server over it is the
speed-up since that commit. On a shared machine, read the ratios (concurrency c over one at a
time; exit, speculation, the compiled server and --versus over plain at the same concurrency)
rather than the absolute tokens/s.

    git worktree add /tmp/before <commit>
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serve_load.py RUN --compile --versus /tmp/before \
        --concurrency 16 --rounds 3
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

# servekit: the tests' server runner
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from benchkit import corpus_windows  # noqa: E402
from servekit import Server, hang_up  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def one(client, prompt: str, tokens: int, extra: dict) -> tuple[float, list[float], int]:
    """One streamed request: (time to first token, gaps between later tokens, tokens received)."""
    start = last = time.perf_counter()
    ttft, gaps, got = None, [], 0
    stream = await client.completions.create(model="bench", prompt=prompt, max_tokens=tokens,
                                             temperature=0,
                                             stream=True, extra_body={"ignore_eos": True, **extra},
                                             stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            got = chunk.usage.completion_tokens
        if not chunk.choices or not chunk.choices[0].text:
            continue
        now = time.perf_counter()
        if ttft is None:
            ttft = now - start
        else:
            gaps.append(now - last)
        last = now
    return ttft, gaps, got


async def bad_and_disconnect(client, prompt: str, args) -> int:
    """The bad requests and hang-ups of a level; returns how many did not behave (400 / a clean
    close)."""
    import openai

    wrong = 0
    for body in [{"bogus_field": 1}, {"temperature": -1}][:args.bad] * max(args.bad // 2, 1):
        try:
            await client.completions.create(model="bench", prompt=prompt, max_tokens=4,
                                            extra_body=body)
            wrong += 1
        except openai.BadRequestError:
            pass
    for _ in range(args.disconnects):
        await hang_up(client, "bench", prompt, args.tokens, after=2)
    return wrong


async def adversary(client, prompt: str, loops: int, tokens: int, stop: asyncio.Event) -> int:
    """Deep requests one after another until `stop`; how many finished."""
    done = 0
    while not stop.is_set():
        await one(client, prompt, tokens, {"loops": loops})
        done += 1
    return done


async def level(server: Server, prompts: list[str], concurrency: int, extra: dict, args) -> dict:
    """Run one (mode, concurrency) level; its throughput and latency figures."""
    extra = dict(extra)
    deep = extra.pop("deep", None)
    gate = asyncio.Semaphore(concurrency)
    deadline = time.perf_counter() + args.seconds
    failures: list[str] = []

    async def guarded(prompt):
        async with gate:
            if time.perf_counter() > deadline:
                return None
            try:
                return await one(client, prompt, args.tokens, extra)
            except Exception as err:  # noqa: BLE001 - counted: a good request must not fail
                failures.append(f"{type(err).__name__}: {err}")
                return None

    before = [server.metric(m) for m in ("meshlm_loop_steps_total", "meshlm_decoded_tokens_total")]
    async with server.client() as client:
        stop = asyncio.Event()
        rival = (asyncio.create_task(adversary(client, prompts[-1], deep, args.tokens, stop))
                 if deep else None)
        start = time.perf_counter()
        results = await asyncio.gather(*(guarded(p) for p in prompts[:args.requests]),
                                       bad_and_disconnect(client, prompts[0], args))
        wall = time.perf_counter() - start
        if rival is not None:
            stop.set()
            await rival
    after = [server.metric(m) for m in ("meshlm_loop_steps_total", "meshlm_decoded_tokens_total")]
    loops = (after[0] - before[0]) / max(after[1] - before[1], 1)
    done, wrong = [r for r in results[:-1] if r is not None], results[-1]
    ttfts, gaps = [r[0] for r in done], [g for r in done for g in r[1]]
    tokens = sum(r[2] for r in done)
    short = sum(r[2] != args.tokens for r in done)
    return {"tokens/s": tokens / wall, "loops/token": loops, "requests": len(done),
            "failed": len(failures) + short,
            "bad not 400": wrong, "ttft p50": percentile(ttfts, 50),
            "ttft p99": percentile(ttfts, 99),
            "itl p50": percentile(gaps, 50), "itl p99": percentile(gaps, 99),
            "errors": failures[:3]}


def modes(args) -> dict[str, dict]:
    out = {"plain": {}}
    if args.exit:
        out[f"exit {args.exit}"] = {"exit": args.exit}
    if args.speculate:
        out[f"speculate {args.speculate}"] = {"speculate": args.speculate}
    if args.deep:
        out[f"+ loops={args.deep} client"] = {"deep": args.deep}
    if args.compile:
        out["plain, compiled"] = {"server": "compiled"}
    if args.versus:
        out[VERSUS] = {"server": "versus"}
    return out


VERSUS = "plain, --versus code"


def report(name: str, c: int, runs: list[dict], base: float | None) -> float:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "errors"}
    ratio = "" if base is None else f" ({med['tokens/s'] / base[0]:.2f}x plain"
    ratio += "" if base is None else f", ITL p99 {med['itl p99'] / base[1]:.2f}x plain)"
    ms = {k: med[k] * 1e3 for k in ("ttft p50", "ttft p99", "itl p50", "itl p99")}
    print(f"{name:>20} c={c:<3} {med['tokens/s']:7.1f} tokens/s{ratio} | TTFT p50 "
          f"{ms['ttft p50']:6.1f} ms p99 {ms['ttft p99']:6.1f} ms | ITL p50 {ms['itl p50']:6.1f} "
          f"ms p99 {ms['itl p99']:6.1f} ms | {med['loops/token']:.2f} loops/token | "
          f"{med['requests']:.0f} req, failed {sum(r['failed'] for r in runs)}, bad not 400 "
          f"{sum(r['bad not 400'] for r in runs)}",
          flush=True)
    for r in runs:
        for e in r["errors"]:
            print(f"    failed: {e}", flush=True)
    return med["tokens/s"], med["itl p99"]


def main() -> None:
    from meshlm.loading import open_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint",
                   help="a model folder (meshlm.loading); a looped one for exit and speculation")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests", type=int, default=32, help="good requests per level (default 32)")
    p.add_argument("--tokens", type=int, default=32, help="tokens per request (default 32)")
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--seconds", type=float, default=60,
                   help="a level starts no request after this (default 60)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--exit", default=None,
                   help="the exit mode's rule, e.g. state:1.0 (omit: no exit mode)")
    p.add_argument("--speculate", default=None,
                   help="the speculation mode's setting, e.g. auto or 2:3")
    p.add_argument("--bad", type=int, default=2, help="bad requests per level (default 2)")
    p.add_argument("--disconnects", type=int, default=2,
                   help="streams per level that hang up early (default 2)")
    p.add_argument("--deep", type=int, default=None, metavar="L",
                   help="add a mode with one client sending loops=L requests meanwhile")
    p.add_argument("--loop-slice", type=int, default=None,
                   help="the server's --loop-slice (default: its own; 0: never slice)")
    p.add_argument("--compile", action="store_true",
                   help="add a mode: plain requests to a second server run with --compile")
    p.add_argument("--versus", type=Path, default=None, metavar="SRC",
                   help="add a mode: plain requests to a server of the meshlm in SRC/src")
    p.add_argument("--server-threads", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=16)
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    tok = open_model(args.checkpoint).tokenizer
    prompts = [tok.decode(w) for w in corpus_windows(tok, args.requests, args.prompt_tokens)]
    options = ["--max-batch", str(args.max_batch), "--max-queue", "1024",
               "--threads", str(args.server_threads),
               *([] if args.deep is None else ["--max-loops", str(args.deep)]),
               *([] if args.loop_slice is None else ["--loop-slice", str(args.loop_slice)])]
    servers = {"eager": Server(Path(args.checkpoint), *options, name="bench")}
    if args.compile:  # the compiled step's warm-up precedes /health
        servers["compiled"] = Server(Path(args.checkpoint), *options, "--compile", name="bench",
                                     ready_within=600)
    if args.versus:
        servers["versus"] = Server(Path(args.checkpoint), *options, name="bench",
                                   src=args.versus.resolve() / "src")
    try:
        results: dict[tuple[str, int], list[dict]] = {}
        plan = [(m, c) for c in levels for m in modes(args)]
        for r in range(args.rounds):
            for name, c in plan if r % 2 == 0 else plan[::-1]:
                mode = dict(modes(args)[name])
                server = servers[mode.pop("server", "eager")]
                out = asyncio.run(level(server, prompts, c, mode, args))
                results.setdefault((name, c), []).append(out)
        for c in levels:
            base = report("plain", c, results[("plain", c)], None)
            for name in list(modes(args))[1:]:
                report(name, c, results[(name, c)], base)
        plain = {c: statistics.median(r["tokens/s"] for r in results[("plain", c)]) for c in levels}
        for c in levels[1:]:
            print(f"plain: concurrency {c} / one at a time: {plain[c] / plain[levels[0]]:.2f}x "
                  "tokens/s")
        for c in levels if args.versus else ():
            before = statistics.median(r["tokens/s"] for r in results[(VERSUS, c)])
            best = plain[c]
            if args.compile:
                best = max(best, statistics.median(r["tokens/s"]
                                                   for r in results[("plain, compiled", c)]))
            print(f"concurrency {c}: this tree's best server over {args.versus}'s: "
                  f"{best / before:.2f}x tokens/s (plain {plain[c] / before:.2f}x)")
    finally:
        for server in servers.values():
            server.stop()


if __name__ == "__main__":
    main()
