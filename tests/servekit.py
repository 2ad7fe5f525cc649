"""`meshlm serve` in a fresh subprocess on a free loopback port, and the openai client that talks to
it."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(src: Path = ROOT / "src") -> dict[str, str]:
    """Only what the interpreter needs: no proxies, no MESHLM_* or torch settings of the
    caller's; meshlm imported from `src`."""
    keep = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
    return {**keep, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}


class Server:
    def __init__(self, folder: Path, *options: str, name: str = "tiny", ready_within: float = 60,
                 src: Path = ROOT / "src"):
        """`meshlm serve folder *options` on a free port, meshlm imported from `src` (another
        checkout's, to compare code versions)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "meshlm.cli", "serve", str(folder), "--port", str(self.port),
               "--name", name,
               "--threads", "1", *options]
        self.proc = subprocess.Popen(cmd, env=clean_env(src), cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE,
                                     text=True)
        self._wait_ready(ready_within)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"meshlm serve exited {self.proc.returncode}: "
                                   f"{self.proc.stderr.read()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=1, trust_env=False).status_code == 200:
                    return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"meshlm serve did not answer /health within {timeout:.0f} s")

    def client(self):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                                  http_client=httpx.AsyncClient(trust_env=False, timeout=60))

    def post(self, path: str, timeout: float = 30, **kw) -> httpx.Response:
        return httpx.post(self.url + path, trust_env=False, timeout=timeout, **kw)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, trust_env=False, timeout=30)

    def metric(self, name: str) -> float:
        """A sample's value from /metrics, e.g.
        'meshlm_requests_finished_total{reason="cancelled"}'."""
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise KeyError(name)

    def terminate(self, timeout: float = 60) -> tuple[int, str]:
        """SIGTERM, then the exit code and stderr once it exited."""
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, err

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate(timeout=30)


async def hang_up(client, model: str, prompt: str, tokens: int, after: int) -> None:
    """Stream a long completion and close the connection after `after` chunks (a client that
    leaves)."""
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=tokens,
                                             stream=True,
                                             extra_body={"ignore_eos": True})
    seen = 0
    async for _ in stream:
        seen += 1
        if seen == after:
            break
    await stream.close()
