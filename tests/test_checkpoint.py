"""Checkpoints: round trip, atomic layout, pruning, refusal of non-finite weights, corruption
detection."""
from __future__ import annotations

import math

import pytest
import torch

from meshlm import checkpoint
from meshlm.config import ModelConfig
from meshlm.data.hashing import sha256_file
from meshlm.errors import CheckpointError
from meshlm.folders import integrity
from meshlm.loading import open_model
from meshlm.model import MeshLM

CFG = ModelConfig.from_preset("tiny")


def write(run, step, val_loss=1.0, keep_last=3, is_best=False, model=None):
    model = model or MeshLM(CFG)
    state = {"step": step, "optimizer": {"state": {}, "param_groups": []}, "best_val": val_loss}
    meta = {"model": CFG.to_dict(), "train": {}, "val_loss": val_loss}
    return checkpoint.save_checkpoint(run, step, model.state_dict(), state, meta,
                                      keep_last=keep_last,
                                      is_best=is_best)


def test_round_trip_and_load_model(tmp_path):
    model = MeshLM(CFG)
    path = write(tmp_path, 5, model=model)
    assert path.name == "step-000005" and (tmp_path / "latest").read_text().strip() == "step-000005"
    ckpt = integrity.load_checkpoint(tmp_path)
    assert ckpt.step == 5 and ckpt.state["step"] == 5
    loaded = open_model(tmp_path).model
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert not list(tmp_path.glob(".tmp-*"))


def test_prune_keeps_last_n_and_best(tmp_path):
    write(tmp_path, 1, val_loss=0.5, is_best=True, keep_last=2)
    for step in (2, 3, 4):
        write(tmp_path, step, keep_last=2)
    assert [p.name for p in integrity.list_checkpoints(tmp_path)] == ["step-000004", "step-000003",
                                                                       "step-000001"]
    assert (tmp_path / "best").read_text().strip() == "step-000001"


def test_refuses_non_finite_weights(tmp_path):
    model = MeshLM(CFG)
    with torch.no_grad():
        model.embed_in.weight[0, 0] = math.nan
    with pytest.raises(CheckpointError, match="non-finite"):
        write(tmp_path, 1, model=model)
    assert not integrity.list_checkpoints(tmp_path)


@pytest.mark.parametrize("victim, damage", [
    ("model.safetensors", "truncate"), ("state.pt", "truncate"), ("model.safetensors", "flip"),
    ("config.json", "truncate"), ("state.pt", "delete"),
])
def test_corruption_names_the_file_and_resume_falls_back(tmp_path, victim, damage):
    write(tmp_path, 1)
    bad = write(tmp_path, 2) / victim
    if damage == "truncate":
        bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    elif damage == "flip":
        data = bytearray(bad.read_bytes())
        data[-10] ^= 0xFF
        bad.write_bytes(bytes(data))
    else:
        bad.unlink()
    with pytest.raises(CheckpointError) as err:
        integrity.load_checkpoint(bad.parent)
    assert str(bad) in str(err.value) and "\n" not in str(err.value)
    warnings = []
    good = checkpoint.find_resumable(tmp_path, warn=warnings.append)
    assert good.step == 1 and (tmp_path / "step-000001").is_dir()
    assert len(warnings) == 1 and "step-000002" in warnings[0]


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        integrity.load_checkpoint(tmp_path)


def test_state_loads_without_executing_code(tmp_path):
    """state.pt must hold only what torch.load(weights_only=True) accepts."""
    path = write(tmp_path, 1)
    torch.load(path / "state.pt", weights_only=True)


# -- the manifest: config.json and every needed file are checksummed; nothing unchecked is loaded
# --------------
def _edit_json(path, change):
    import json

    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def test_an_edited_config_json_is_refused(tmp_path):
    path = write(tmp_path, 1)
    # same shapes: would load silently
    _edit_json(path / "config.json", lambda d: d["model"].update(scheme="base"))
    with pytest.raises(CheckpointError, match="config.json was edited or is corrupt"):
        open_model(path)


def test_a_missing_or_edited_manifest_is_refused(tmp_path):
    path = write(tmp_path, 1)
    (path / "manifest.json").rename(path / "saved.json")
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        integrity.load_checkpoint(path)
    (path / "saved.json").rename(path / "manifest.json")
    _edit_json(path / "manifest.json", lambda d: d["files"]["state.pt"].update(bytes=7))
    with pytest.raises(CheckpointError, match="manifest.json was edited"):
        integrity.load_checkpoint(path)


def test_a_manifest_must_cover_every_needed_file(tmp_path):
    path = write(tmp_path, 1)

    def drop_state(d):
        del d["files"]["state.pt"]
        d["sha256"] = integrity.digest(d["files"])
    _edit_json(path / "manifest.json", drop_state)
    with pytest.raises(CheckpointError, match="does not cover state.pt"):
        integrity.verify(path)


def test_a_checkpoint_from_before_manifests_is_refused_until_resealed(tmp_path):
    path = write(tmp_path, 1)
    files = {n: {"bytes": (path / n).stat().st_size, "sha256": sha256_file(path / n)}
             for n in ("model.safetensors", "state.pt")}
    # the old layout: files inside config.json
    _edit_json(path / "config.json", lambda d: d.update(files=files))
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="python -m meshlm.checkpoint reseal"):
        open_model(path)
    checkpoint.reseal(path)
    open_model(path)


def test_reseal_refuses_to_sign_an_edit_of_a_sealed_checkpoint_unless_forced(tmp_path):
    """An edited config.json (here: another model width) must not become trusted by running reseal
    on it."""
    import subprocess
    import sys

    from trainkit import cli_command

    path = write(tmp_path, 1)
    assert checkpoint.reseal(path) == path / "manifest.json"  # sealed and intact: left alone
    before = (path / "manifest.json").read_bytes()
    _edit_json(path / "config.json", lambda d: d.update(note="edited"))
    with pytest.raises(CheckpointError,
                       match="already sealed and no longer matches its manifest.json .*--force"):
        checkpoint.reseal(path)
    assert (path / "manifest.json").read_bytes() == before
    cmd, env = cli_command()
    refused = subprocess.run([sys.executable, "-m", "meshlm.checkpoint", "reseal", str(path)],
                             capture_output=True,
                             text=True, env=env)
    assert refused.returncode == 1 and "pass --force" in refused.stderr
    forced = subprocess.run([sys.executable, "-m", "meshlm.checkpoint", "reseal", str(path),
                             "--force"],
                            capture_output=True, text=True, env=env)
    assert forced.returncode == 0, forced.stderr
    integrity.verify(path)


class Payload:
    """Stands for any object whose unpickling could run code."""


def test_state_is_loaded_without_executing_code(tmp_path):
    """A state.pt that needs unpickling of arbitrary objects is refused even when its checksum
    matches."""
    path = write(tmp_path, 1)
    torch.save({"step": 1, "payload": Payload()}, path / "state.pt")  # not an allowed global
    files = {n: {"bytes": (path / n).stat().st_size, "sha256": sha256_file(path / n)}
             for n in ("model.safetensors", "state.pt", "config.json")}
    _edit_json(path / "manifest.json",
               lambda d: d.update(files=files, sha256=integrity.digest(files)))
    with pytest.raises(CheckpointError,
                       match="state.pt holds pickled Python objects beyond plain tensors, which "
                             "meshlm never unpickles") as err:
        integrity.load_checkpoint(path)
    # torch's advice (weights_only=False) would run the file's code
    assert "weights_only" not in str(err.value)


@pytest.mark.parametrize("fail_in", ["save_file", "torch.save", "_write_json"])
def test_a_full_disk_leaves_no_temporary_folder_and_keeps_earlier_checkpoints(tmp_path, monkeypatch,
                                                                              fail_in):
    import errno

    from meshlm.errors import StorageError

    write(tmp_path, 1)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))
    monkeypatch.setattr(f"meshlm.checkpoint.{fail_in}", full)
    with pytest.raises(StorageError, match=r"writing checkpoint .*step-000002: no space left on "
                                           r"device \(.* free\)"):
        write(tmp_path, 2)
    assert not list(tmp_path.glob(".t*"))
    assert [p.name for p in integrity.list_checkpoints(tmp_path)] == ["step-000001"]
    assert (tmp_path / "latest").read_text().strip() == "step-000001"
    integrity.load_checkpoint(tmp_path)


def test_write_failures_reported_by_safetensors_or_torch_are_storage_errors(tmp_path, monkeypatch):
    """On a real full disk safetensors raises SafetensorError ("os error 28") and torch.save a
    RuntimeError ("unexpected pos …"), not OSError (seen on a 16 MB tmpfs); both become the one-line
    StorageError."""
    import shutil as shutil_module
    from collections import namedtuple

    from safetensors import SafetensorError

    from meshlm.errors import StorageError

    write(tmp_path, 1)

    def safetensors_full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os "
                              "error 28)")
    with monkeypatch.context() as mp:
        mp.setattr("meshlm.checkpoint.save_file", safetensors_full)
        with pytest.raises(StorageError, match="no space left on device"):
            write(tmp_path, 2)

    def torch_full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 2117568 vs "
                           "2117520")
    usage = namedtuple("usage", "total used free")
    with monkeypatch.context() as mp:
        mp.setattr("meshlm.checkpoint.torch.save", torch_full)
        mp.setattr(shutil_module, "disk_usage", lambda path: usage(10, 10, 0))
        with pytest.raises(StorageError, match="no space left on device"):
            write(tmp_path, 2)
    assert (not list(tmp_path.glob(".t*"))
            and [p.name for p in integrity.list_checkpoints(tmp_path)] == ["step-000001"])


def test_every_checkpoint_file_gets_the_same_permissions(tmp_path):
    """model.safetensors came out 0600 (safetensors' own default) beside 0644 files: unreadable to a
    group that could read the rest of the checkpoint."""
    path = write(tmp_path, 1)
    modes = {p.name: p.stat().st_mode & 0o777 for p in path.iterdir()}
    assert len(set(modes.values())) == 1, modes


def _unhashed(run):
    return integrity.load_checkpoint(run, check=False)  # hashing would call any edit "edited"


@pytest.mark.parametrize("text, message", [
    ("{not json", r"config.json is unreadable or not JSON \(.*\); use an earlier checkpoint"),
    ("[1, 2]", r"config.json is not a JSON object; use an earlier checkpoint"),
    ("{}", r"config.json is not a meshlm checkpoint config"),
])
def test_a_damaged_config_json_is_one_line_from_the_one_json_reader(tmp_path, text, message):
    path = write(tmp_path, 1)
    (path / "config.json").write_text(text)
    for read in (integrity.read_meta, _unhashed):
        with pytest.raises(CheckpointError, match=message) as err:
            read(tmp_path)  # the run dir: its `latest` checkpoint
        assert "\n" not in str(err.value)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError,
                       match="config.json is missing: the checkpoint is incomplete"):
        integrity.read_meta(path)
