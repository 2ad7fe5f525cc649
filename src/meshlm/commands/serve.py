"""`meshlm serve RUN_OR_FOLDER`: an OpenAI-compatible HTTP server with continuous batching
(docs/serve.md).

RUN_OR_FOLDER is anything `meshlm generate` opens (meshlm.loading). The server listens on 127.0.0.1
by default; `--max-batch` rows decode together, `--max-queue` requests may wait (more get 429), each
request may run for `--timeout` seconds; while rows decode, a longer prompt prefills
`--prefill-chunk` tokens per step. SIGTERM stops admitting (503, and /health answers 503
"draining"), lets the running requests finish within `--grace` seconds, ends those still running
with an error, and exits 0; Ctrl-C does the same and exits 130.
"""
from __future__ import annotations

import argparse
import signal
import sys

from meshlm.runtime.options import add_dtype_argument

# tokens per prefill chunk: benchmarks/chunked_prefill.py (docs/serve.md) measures the trade
DEFAULT_PREFILL_CHUNK = 256


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="RUN_OR_FOLDER",
                   help="run or checkpoint dir, converted/retrofitted folder, or Hugging Face "
                        "folder")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--name", default=None,
                   help="model name clients pass as `model` (default: the folder's name)")
    p.add_argument("--max-batch", type=int, default=16, help="rows decoding together (default 16)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a row; more get 429 (default 64)")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, metavar="N",
                   help="while other rows decode, prefill longer prompts N tokens per step, so "
                        f"they do not stall the others (0: whole prompts; default "
                        f"{DEFAULT_PREFILL_CHUNK})")
    p.add_argument("--max-loops", type=int, default=None, metavar="N",
                   help="the most core passes a request's `loops` may ask for (default: 4x the "
                        "trained count)")
    p.add_argument("--loop-slice", type=int, default=None, metavar="N",
                   help="while other requests decode, a request's token runs at most N loop "
                        "steps per boundary, so deep `loops` asks cannot stall the others "
                        "(default: the trained count; 0: never slice)")
    p.add_argument("--compile", action="store_true",
                   help="decode plain requests' tokens through a compiled step (torch.compile), "
                        "compiled at start-up and kept where it beats the eager step "
                        "(docs/serve.md)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a request may run (default 600)")
    p.add_argument("--grace", type=float, default=30.0,
                   help="on SIGTERM, seconds the running requests get to finish (default 30)")
    p.add_argument("--tokenizer", default=None,
                   help="override the folder's tokenizer ('default', 'pythia' or a tokenizer.json)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    add_dtype_argument(p, decoding=True)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="uvicorn's log level (default warning)")


def check_inputs(args: argparse.Namespace) -> None:
    """Every problem with the options in one error, before the model is loaded."""
    from pathlib import Path

    from meshlm.errors import Problems
    from meshlm.runtime.devices import resolve_device

    p = Problems()
    p.need(0 <= args.port <= 65535, f"--port {args.port} must be in 0 … 65535")
    p.need(args.max_batch >= 1, f"--max-batch {args.max_batch} must be >= 1")
    p.need(args.max_queue >= 0, f"--max-queue {args.max_queue} must be >= 0")
    p.need(args.loop_slice is None or args.loop_slice >= 0,
           f"--loop-slice {args.loop_slice} must be >= 0 (0: never slice)")
    p.need(args.max_loops is None or args.max_loops >= 1,
           f"--max-loops {args.max_loops} must be >= 1 (omit it for 4x the trained count)")
    p.need(args.prefill_chunk >= 0, f"--prefill-chunk {args.prefill_chunk} must be >= 0 (0: "
                                    "whole prompts)")
    p.need(args.timeout > 0, f"--timeout {args.timeout} must be > 0 seconds")
    p.need(args.grace >= 0, f"--grace {args.grace} must be >= 0 seconds")
    p.need(args.threads is None or args.threads >= 1, f"--threads {args.threads} must be >= 1")
    p.check(resolve_device, args.device)
    p.need(Path(args.checkpoint).is_dir(), f"{args.checkpoint} is not a folder; pass a meshlm run "
                                           "or step-NNNNNN folder, or a Hugging Face folder "
                                           "written by `meshlm convert --to hf`")
    p.raise_if_any()


def needs_extra() -> None:
    """ConfigError naming the install command when the serve extra is missing."""
    import importlib.util

    from meshlm.errors import ConfigError

    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client", "jinja2")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"meshlm serve needs {', '.join(missing)}; install the serve extra: "
                          f"pip install -c constraints.txt -e '.[serve]'")


def run(args: argparse.Namespace) -> int:
    check_inputs(args)
    needs_extra()
    import torch
    import uvicorn

    from meshlm.decoding import for_decoding
    from meshlm.loading import open_model
    from meshlm.runtime import precision
    from meshlm.serve.app import Served, create_app
    from meshlm.serve.engine import Engine
    from meshlm.serve.text import chat_template

    if args.threads:
        torch.set_num_threads(args.threads)
    opened = open_model(args.checkpoint, args.device, tokenizer=args.tokenizer)
    model, tok = opened.model, opened.tokenizer
    device, chosen = for_decoding(args.dtype, model, huge=True)  # a server decodes for long
    template, own = chat_template(opened.folder.chat_template)  # a fine-tuned run's: its own
    cfg = model.config
    name = args.name or opened.run_dir.resolve().name
    served = Served(name=name, tokenizer=tok, context_length=cfg.context_length,
                    chat_template=template,
                    own_template=own, timeout=args.timeout,
                    info={"spec": cfg.spec, "scheme": cfg.scheme,
                          "context_length": cfg.context_length,
                          "precision": chosen.name,
                          "chat_template": "folder" if own else "meshlm default"})
    def autocast():
        return precision.autocast(device, chosen)
    batcher = batcher_for(args, model, tok, autocast)
    engine = Engine(batcher, autocast)
    app = create_app(engine, served)
    app.router.on_startup.append(engine.start)
    app.router.on_shutdown.append(engine.stop)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5,  # after the drain: see draining_server
                            lifespan="on")
    server = draining_server(config, engine, args.grace)
    # a port in use is a one-line error here, not uvicorn's exit
    sock = listening_socket(args.host, args.port)
    port = sock.getsockname()[1]  # --port 0: the one the system chose
    print(f"meshlm serve: {name} ({cfg.spec} {cfg.scheme}) on http://{args.host}:{port}/v1 in "
          f"{chosen.describe()}; max batch {args.max_batch}, queue {args.max_queue}",
          file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    return 0


def batcher_for(args: argparse.Namespace, model, tok, autocast):
    """The server's Batcher; with --compile, its step compiled before the server listens."""
    from meshlm.serve.batcher import Batcher

    batcher = Batcher(model, tok.eos_id, tok.pad_id, args.max_batch, args.max_queue,
                      args.prefill_chunk or None, args.max_loops, args.loop_slice,
                      compile=args.compile)
    if args.compile:
        with autocast():
            print(f"meshlm serve: {batcher.warm()}", file=sys.stderr, flush=True)
    return batcher


def listening_socket(host: str, port: int):
    """A bound TCP socket for host:port; OSError (EADDRINUSE …) reworded with the fix."""
    import socket

    from meshlm.errors import ConfigError

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({err.strerror}); pass another --port "
                          "(0: any free one) or stop what holds it") from err
    return sock


def draining_server(config, engine, grace: float):
    """A uvicorn.Server whose SIGTERM drains observably: the engine refuses new requests (503) and
    /health answers 503 "draining" at once, while the listening socket stays open; the running
    requests get up to `grace` seconds to finish; any still running then end with an error (a
    stream's last event, else a 503 body) rather than a cut connection; then the server closes and
    the process exits 0 (uvicorn itself re-raises a signal after shutting down, which would end it
    with 143). Ctrl-C drains the same way and then stops with 130; a second Ctrl-C stops at
    once."""
    import asyncio
    import time

    import uvicorn

    class Server(uvicorn.Server):
        loop = None
        draining = None

        async def startup(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets)

        def handle_exit(self, sig, frame):
            if self.draining is not None or self.loop is None:  # again, or before startup
                return super().handle_exit(sig, frame)
            engine.draining = True
            self.draining = asyncio.run_coroutine_threadsafe(self.drain(sig), self.loop)

        async def drain(self, sig):
            deadline = time.monotonic() + grace
            while engine.busy() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            engine.shut_down()  # what is left ends with an error, not a cut connection
            while engine.busy() and time.monotonic() < deadline + 5:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.1)  # the last events reach their clients
            if sig == signal.SIGTERM:
                self.should_exit = True
            else:
                super().handle_exit(sig, None)

    return Server(config)
