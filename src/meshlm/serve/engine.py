"""The batcher in a thread of its own, and the bridge from it to asyncio.

The decoding thread runs `Batcher.serve` inside the chosen precision's autocast (autocast is per
thread, so it is entered there). `Engine.open(request)` submits a request and yields its new tokens
as the thread delivers them: the batcher's callbacks hop onto the event loop with
call_soon_threadsafe. Leaving the iterator early (a client that disconnected, a stop string) cancels
the request, and its batch row is freed at the next token boundary. `draining` is set on SIGTERM:
the app then refuses new requests while the running ones finish, and `shut_down` ends those
left when the grace period runs out.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import torch

from meshlm.serve.batcher import Batcher, Request


class Engine:
    def __init__(self, batcher: Batcher, autocast):
        self.batcher = batcher
        self._autocast = autocast  # a context-manager factory: the precision to decode in
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.draining = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="meshlm-batcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        torch.set_grad_enabled(False)  # per thread, like autocast
        with self._autocast():
            self.batcher.serve(self._stop)

    def stop(self) -> None:
        """End the decoding thread (it notices within Batcher.serve's idle wait)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def busy(self) -> bool:
        """Requests are running or waiting."""
        return bool(self.batcher.running or self.batcher.queued)

    def shut_down(self) -> None:
        """End every running and waiting request at the next token boundary with finish
        "shutdown" (the drain's grace ran out)."""
        for r in self.batcher.requests():
            self.batcher.cancel(r, "shutdown")

    def open(self, request: Request) -> AsyncIterator[list[int]]:
        """Submit the request (ConfigError / QueueFull are raised here, before anything is sent) and
        return an async iterator of its token lists, which ends when the request finishes
        (request.finish says why)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[list[int] | None] = asyncio.Queue()
        request.on_tokens = lambda r, tokens: loop.call_soon_threadsafe(queue.put_nowait,
                                                                        list(tokens))
        request.on_done = lambda r: loop.call_soon_threadsafe(queue.put_nowait, None)
        self.batcher.submit(request)
        return self._tokens(request, queue)

    async def _tokens(self, request: Request, queue: asyncio.Queue) -> AsyncIterator[list[int]]:
        try:
            while (tokens := await queue.get()) is not None:
                yield tokens
        finally:
            if request.finish is None:  # the consumer left early: free the slot
                self.batcher.cancel(request)
