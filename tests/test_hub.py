"""Hugging Face Hub names (meshlm.folders.hub) in every command that takes a model folder, offline
against a Hub cache laid out as huggingface_hub lays one out (made here; huggingface_hub's own
scan_cache_dir reads it back). Only the download itself is not exercised."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from meshlm.cli import main
from meshlm.errors import CheckpointError
from meshlm.folders.hub import exists, is_hub_name, resolve

REPO = "acme/llama-tiny"


def hub_cache(cache, repo, folder, refs=("main",)):
    """Put `folder`'s files into a Hub cache as one commit of `repo` that every ref in `refs` points
    to: blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>, refs/<ref> = commit.
    Returns the commit."""
    from huggingface_hub.file_download import repo_folder_name

    storage = cache / repo_folder_name(repo_id=repo, repo_type="model")
    commit = hashlib.sha1(f"{repo}:{sorted(os.listdir(folder))}".encode()).hexdigest()
    snapshot = storage / "snapshots" / commit
    for sub in ("blobs", "refs"):
        (storage / sub).mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (storage / "refs" / ref).write_text(commit)
    return commit


@pytest.fixture
def offline_cache(tmp_path, llama_folder, monkeypatch):
    """HF_HUB_OFFLINE=1 and HF_HUB_CACHE=<a cache holding acme/llama-tiny at main and v1>, set where
    huggingface_hub reads them (its constants, read from the environment at import); cwd is
    tmp_path."""
    from huggingface_hub import constants

    cache = tmp_path / "hub-cache"
    commit = hub_cache(cache, REPO, llama_folder[0], refs=("main", "v1"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    return cache, commit


def test_the_cache_made_here_is_huggingface_hubs_own_layout(offline_cache):
    from huggingface_hub import scan_cache_dir

    cache, commit = offline_cache
    info = scan_cache_dir(cache)
    assert not info.warnings
    (repo,) = info.repos
    (revision,) = repo.revisions
    assert (repo.repo_id == REPO and revision.commit_hash == commit
            and revision.refs == {"main", "v1"})
    assert {f.file_name for f in revision.files} >= {"config.json", "model.safetensors",
                                                     "tokenizer.json"}


def test_names_paths_and_revisions(offline_cache, tmp_path):
    cache, commit = offline_cache
    assert is_hub_name(REPO) and is_hub_name(f"{REPO}@v1") and is_hub_name("runs/nope")
    assert (not is_hub_name("/abs/path") and not is_hub_name("./rel/x")
            and not is_hub_name("one-part"))
    (tmp_path / "acme" / "llama-tiny").mkdir(parents=True)
    assert resolve(REPO) == (Path("acme/llama-tiny"), None)  # an existing local path always wins
    (tmp_path / "acme" / "llama-tiny").rmdir()
    snapshot = cache / "models--acme--llama-tiny" / "snapshots" / commit
    assert resolve(REPO) == (snapshot, f"{REPO}@{commit}")
    assert resolve(f"{REPO}@v1") == resolve(f"{REPO}@{commit}") == (snapshot, f"{REPO}@{commit}")
    assert exists(REPO) and not exists(tmp_path / "nope")


def test_offline_without_a_cached_copy_is_one_clear_line(offline_cache, capsys):
    with pytest.raises(CheckpointError,
                       match=r"acme/absent is not a local folder nor in the Hugging Face cache .*"
                             r"HF_HUB_OFFLINE is set; download it once online"):
        resolve("acme/absent")
    with pytest.raises(CheckpointError,
                       match="acme/llama-tiny@nope is not a local folder nor in the Hugging Face"):
        resolve(f"{REPO}@nope")  # a revision the cache does not hold
    assert main(["generate", "acme/absent", "Hello", "-n", "2"]) == 1  # a CheckpointError
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "acme/absent" in err and "HF_HUB_OFFLINE" in err


def test_unknown_name_online_is_one_clear_line(monkeypatch):
    """The mapping of huggingface_hub's not-found error (the one piece that would need the
    network)."""
    import httpx
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    def not_found(*args, **kwargs):
        url = "https://huggingface.co/api/models/acme/nope/revision/main"
        raise RepositoryNotFoundError("404 Client Error. Repository Not Found",
                                      response=httpx.Response(404,
                                                              request=httpx.Request("GET", url)))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", not_found)
    with pytest.raises(CheckpointError,
                       match=r"^acme/nope is neither a local folder nor a model on the Hugging "
                             r"Face Hub \(or it is private"):
        resolve("acme/nope")


def test_every_command_that_takes_a_folder_takes_a_hub_name(offline_cache, llama_folder, prepared,
                                                            tmp_path,
                                                            capsys):
    from meshlm.folders.locate import locate
    from meshlm.loading import open_model

    _, commit = offline_cache
    local = open_model(llama_folder[0]).model
    x = torch.randint(0, 8192, (2, 9))
    assert main(["convert", REPO, "converted"]) == 0
    converted = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert converted["source"]["path"] == REPO
    with torch.no_grad():
        assert torch.equal(open_model(tmp_path / "converted").model(x).logits, local(x).logits)
    assert main(["retrofit", f"{REPO}@v1", "retrofitted", "--spec", "1+2R2+1"]) == 0
    assert (tmp_path / "retrofitted" / "tokenizer.json").is_file()
    capsys.readouterr()
    prompt = ["Once upon a time", "-n", "5", "-t", "0", "--dtype", "fp32"]
    assert (main(["generate", REPO, *prompt]) == 0
            and main(["generate", str(llama_folder[0]), *prompt]) == 0)
    from_hub, from_folder = capsys.readouterr().out.split("\n", 1)
    assert from_hub + "\n" == from_folder and from_hub.strip()
    assert (main(["eval", REPO, "--tasks", "none", "--loops", "none", "--data", str(prepared),
                  "--limit", "2",
                  "--dtype", "fp32"]) == 0)
    # results beside, not in the cache
    result = json.loads((tmp_path / "acme--llama-tiny" / "eval.json").read_text())
    assert result["perplexity"]
    assert (main(["train", f"train.init_from={REPO}", f"train.data={prepared}",
                  f"train.out_dir={tmp_path}",
                  "train.name=from-hub", "train.steps=1", "train.seq_len=32",
                  "train.global_batch=4",
                  "train.micro_batch=4", "train.progress=false", "train.tensorboard=false",
                  "train.eval_every=0"]) == 0)
    trained = locate(tmp_path / "from-hub")
    assert (trained.train["init_from"] == REPO
            and trained.model_config() == open_model(REPO).model.config)


@pytest.mark.slow  # a fresh interpreter: the environment variables, as a user sets them
def test_the_cli_reads_hf_hub_offline_and_hf_hub_cache_from_the_environment(tmp_path, llama_folder):
    cache = tmp_path / "hub-cache"
    hub_cache(cache, REPO, llama_folder[0])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    run = [sys.executable, "-m", "meshlm.cli", "generate", REPO, "Hello", "-n", "3", "-t", "0"]
    done = subprocess.run(run, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0 and done.stdout.strip(), done.stderr[-2000:]
    env["HF_HUB_CACHE"] = str(tmp_path / "empty-cache")
    done = subprocess.run(run, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 1 and "HF_HUB_OFFLINE is set" in done.stderr
