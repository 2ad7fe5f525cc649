"""Hugging Face Hub names wherever meshlm takes a model folder: `org/name` or `org/name@revision`.

    meshlm retrofit EleutherAI/pythia-160m out/pythia-mesh --spec 4+4R2+4
    meshlm eval EleutherAI/pythia-160m@step143000 --tasks lambada_openai

A local path that exists always wins, so `runs/mesh` is that folder and never a repository. Anything
else of the form org/name[@revision] is fetched with `huggingface_hub.snapshot_download`, with all
of its conventions: the cache (HF_HUB_CACHE, HF_HOME), HF_HUB_OFFLINE=1 (the cached snapshot only,
no network), and the token from its usual place (HF_TOKEN, or `hf auth login`). Only what meshlm
reads is fetched: the JSON files (config, tokenizer, index) and the safetensors weights, or the
PyTorch .bin weights where a repository has no safetensors. Results about a Hub model (eval, probe)
go to ./<org>--<name>, never into the cache.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from meshlm.errors import CheckpointError

HUB_NAME = re.compile(
    r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")
# config, tokenizer, weights (+ vocab files)
FILES = ["*.json", "*.safetensors", "*.txt", "*.model"]
BIN_FILES = ["*.bin"]  # only where a repository has no safetensors


def is_hub_name(source: str | os.PathLike) -> bool:
    """`org/name[@revision]` and not an existing local path."""
    text = str(source)
    return bool(HUB_NAME.match(text)) and not Path(text).expanduser().exists()


def exists(source: str | os.PathLike) -> bool:
    """A local path that exists, or a Hub name (whether the Hub has it is known only when it is
    fetched)."""
    return Path(source).expanduser().exists() or is_hub_name(source)


def resolve(source: str | os.PathLike) -> tuple[Path, str | None]:
    """(local folder, "org/name@commit" when it came from the Hub, else None); a Hub name is
    fetched."""
    if not is_hub_name(source):
        return Path(source).expanduser(), None
    match = HUB_NAME.match(str(source))
    repo, revision = match["repo"], match["revision"]
    folder = _snapshot(repo, revision, FILES)
    if not any(folder.glob("*.safetensors")) and not _offline():
        folder = _snapshot(repo, revision, FILES + BIN_FILES)
    return folder, f"{repo}@{folder.name}"  # a snapshot folder is named by its commit


def prefetch(source: str | os.PathLike) -> None:
    """Fetch a Hub name now, under the user's own HF_HUB_OFFLINE: `meshlm eval` and `meshlm probe`
    import meshlm.evaluation, which switches the Hub off for lm-eval's datasets (huggingface_hub
    reads it once)."""
    if is_hub_name(source):
        resolve(source)


def results_dir(hub_id: str) -> Path:
    """Where eval/probe results about a Hub model go: ./<org>--<name> (the cache is not ours to
    write)."""
    return Path.cwd() / hub_id.partition("@")[0].replace("/", "--")


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _snapshot(repo: str, revision: str | None, patterns: list[str]) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = f"{repo}@{revision}" if revision else repo
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except GatedRepoError:
        raise CheckpointError(f"{name} is a gated Hugging Face model; accept its terms on "
                              "huggingface.co and log in (`hf auth login` or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{name}: the Hugging Face Hub has no revision {revision!r} of "
                              f"{repo}; pass a branch, tag or commit it has") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{name} is neither a local folder nor a model on the Hugging Face "
                              "Hub (or it is private: log in with `hf auth login`); check the "
                              "path or name") from None
    except LocalEntryNotFoundError:
        why = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE
               else "the Hugging Face Hub is unreachable")
        raise CheckpointError(f"{name} is not a local folder nor in the Hugging Face cache "
                              f"{constants.HF_HUB_CACHE}, and {why}; download it once online (or "
                              "point HF_HUB_CACHE at a cache holding it)") from None
    except (OSError, ValueError) as err:  # HTTP errors, a full disk, an invalid repo id
        raise CheckpointError(f"{name}: fetching from the Hugging Face Hub failed "
                              f"({str(err).splitlines()[0][:160]}); check the name and the "
                              "connection") from None
