"""Bad inputs and faults for every command, each with the exit code and message it must get.

`CASES` drives tests/test_faults.py (each case: exit code, message, no traceback, nothing on stdout
before an error, its row in docs/errors.md) and scripts/errors_table.py, which writes docs/errors.md
from the messages the cases really get, so the table cannot drift from the code.
"""
from __future__ import annotations

import contextlib
import errno
import io
import itertools
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from trainkit import make_task_data

from meshlm.train.config import SHIPPED_CONFIGS

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "errors.md"


# -- the shared world: a corpus, its prepared data and a tiny trained run --------------------------
def build_world(root: Path) -> dict[str, Path]:
    from meshlm.data.corpus import default_documents
    from meshlm.data.prepare import prepare
    from meshlm.train.config import TrainConfig
    from meshlm.train.trainer import train

    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    for i, doc in enumerate(itertools.islice(default_documents(), 12)):
        (corpus / f"doc{i:02d}.txt").write_text(doc["text"][:8000])
    data = root / "data"
    prepare(sorted(corpus.glob("*.txt")), data, "default", val_fraction=0.2, progress=False)
    cfg = TrainConfig(model={"preset": "tiny", "vocab_size": 8192}, data=str(data),
                      out_dir=str(root), name="run",
                      seq_len=32, global_batch=4, micro_batch=4, steps=2, eval_every=0,
                      eval_windows=4,
                      save_every=2, progress=False, tensorboard=False, peak_flops=1e11)
    train(cfg, log=lambda message: None)
    return {"corpus": corpus, "data": data, "run": root / "run"}


# -- helpers for setups ----------------------------------------------------------------------------
def copy_run(tmp: Path, world: dict[str, Path]) -> Path:
    run = tmp / "run"
    shutil.copytree(world["run"], run)
    return run


def quantized_copy(tmp: Path, world: dict[str, Path]) -> None:
    """tmp/run (a copy of the run) with an int8 checkpoint of it at tmp/run/int8."""
    from meshlm.checkpoint import save_model
    from meshlm.loading import open_model
    from meshlm.quant import quantize_model

    opened = open_model(copy_run(tmp, world))
    model, spec = quantize_model(opened.model, 8)
    save_model(model, tmp / "run" / "int8",
               {**opened.meta, "quantization": {**spec, "source": {"path": str(opened.path)}}})


def step_dir(tmp: Path) -> Path:
    return tmp / "run" / "step-000002"


def edit_json(path: Path, change: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def write(path: Path, content: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())


def raise_oserror(code: int):
    def fail(*args, **kwargs):
        name = next((str(a) for a in args if isinstance(a, (str, Path))), None)
        raise OSError(code,
                      {errno.ENOSPC: "No space left on device", errno.EACCES: "Permission denied",
                       errno.EDQUOT: "Disk quota exceeded",
                       errno.EROFS: "Read-only file system"}[code], name)
    return fail


def full_disk(mp: pytest.MonkeyPatch, tmp: Path) -> None:
    """Every file write through pathlib and safetensors (meshlm's and transformers') fails with
    ENOSPC."""
    from safetensors import SafetensorError

    def safetensors_full(tensors, filename, *args, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                              'message: "No space left on device" })')
    mp.setattr(Path, "write_text", raise_oserror(errno.ENOSPC))
    mp.setattr(Path, "write_bytes", raise_oserror(errno.ENOSPC))
    mp.setattr("transformers.modeling_utils.safe_save_file", safetensors_full)
    mp.setattr("meshlm.interop.convert.save_file", safetensors_full)


def no_cuda(mp: pytest.MonkeyPatch, tmp: Path) -> None:
    import torch

    mp.setattr(torch.cuda, "is_available", lambda: False)


def empty_cache(mp: pytest.MonkeyPatch, tmp: Path) -> None:
    mp.setenv("MESHLM_CACHE", str(tmp / "empty-cache"))


# -- the cases -------------------------------------------------------------------------------------
@dataclass
class Case:
    command: str
    what: str  # the bad input or fault, in words
    argv: list[str]  # {tmp}, {run}, {data}, {corpus}, {ckpt} = {tmp}/run/step-000002 are filled in
    code: int
    needle: str  # must appear in the message
    setup: Callable[[Path, dict], None] | None = None
    patch: Callable[[pytest.MonkeyPatch, Path], None] | None = None
    after: Callable[[Path], None] | None = None  # more checks on what is left on disk
    runner: Callable[[Path, dict], tuple[int, str, str]] | None = None  # instead of main()
    # in-process
    slow: bool = False
    id: str = field(default="")


def _no_tmp_left(tmp: Path) -> None:
    left = [p for p in tmp.rglob(".t*-step-*")] + [p for p in tmp.rglob("*.tmp")]
    assert not left, left


def _earlier_checkpoint_intact(tmp: Path) -> None:
    from meshlm.folders import integrity

    _no_tmp_left(tmp)
    assert integrity.verify(step_dir(tmp))["step"] == 2
    assert (tmp / "run" / "latest").read_text().strip() == "step-000002"


def _no_shards_left(tmp: Path) -> None:
    assert not list((tmp / "out").glob("*.bin")) and not (tmp / "out" / "manifest.json").exists()
    _no_tmp_left(tmp)


def _partial_eval_kept(tmp: Path) -> None:
    result = json.loads((tmp / "run" / "eval.json").read_text())
    assert result["complete"] is False and result["perplexity"]["tokens"] > 0


def signal_runner(signals: list[int]) -> Callable:
    """`meshlm train` in a subprocess, sent `signals` once it has logged two steps."""
    def run(tmp: Path, world: dict[str, Path]) -> tuple[int, str, str]:
        import os

        out = tmp / "runs"
        args = ["train", "model.preset=tiny", "model.vocab_size=8192", "model.d_model=128",
                "model.spec=2+4R4+2",
                f"train.data={world['data']}", f"train.out_dir={out}", "train.name=run",
                "train.seq_len=32",
                "train.global_batch=4", "train.micro_batch=4", "train.steps=500",
                "train.save_every=0",
                "train.eval_every=0", "train.progress=false", "train.tensorboard=false",
                "train.peak_flops=1e11"]
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
               "MESHLM_DEBUG": ""}
        proc = subprocess.Popen([sys.executable, "-m", "meshlm.cli", *args], env=env, cwd=tmp,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        metrics, deadline = out / "run" / "metrics.jsonl", time.time() + 180
        while time.time() < deadline and proc.poll() is None:
            if metrics.is_file() and metrics.read_text().count('"kind": "train"') >= 2:
                break
            time.sleep(0.01)
        err = []
        for i, sig in enumerate(signals):
            proc.send_signal(sig)
            # the first one was handled
            while i + 1 < len(signals) and (line := proc.stderr.readline()):
                err.append(line)
                if "stopping after this step" in line:
                    break
        stdout, stderr = proc.communicate(timeout=180)
        return proc.returncode, stdout, ("".join(err) + stderr).replace(str(out), "<tmp>/runs")
    return run


def rank_fault_runner(fault: str) -> Callable:
    """2-rank `meshlm train` under torchrun with rank 1 stopped or killed: what rank 0 says
    (trainkit)."""
    def run(tmp: Path, world: dict[str, Path]) -> tuple[int, str, str]:
        from trainkit import train_with_rank_fault

        code, stderr, _ = train_with_rank_fault(world["data"], tmp, fault)
        return (1 if code else 0), "", stderr
    return run


def _prepare_without_validation(tmp: Path, world) -> None:
    from meshlm.data.prepare import prepare

    prepare(sorted(world["corpus"].glob("*.txt")), tmp / "out", "default", val_fraction=0.0,
            progress=False)


def _edit_shard(tmp: Path, world, token: int, keep_checksum: bool) -> None:
    """A copy of the prepared data with one training token overwritten; the manifest keeps its
    checksums (a shard changed behind its back), or forgets them (data prepared before meshlm
    recorded any)."""
    import numpy as np

    shutil.copytree(world["data"], tmp / "data")
    shard = np.memmap(tmp / "data" / "train-00000.bin", dtype=np.uint16, mode="r+")
    shard[100] = token if shard[100] != token else token + 1
    shard.flush()
    if not keep_checksum:
        def forget(manifest):
            for split in manifest["splits"].values():
                for entry in split["shards"]:
                    entry.pop("sha256", None)
                    entry.pop("max_id", None)
        edit_json(tmp / "data" / "manifest.json", forget)


def _stale_max_id(tmp: Path, world) -> None:
    """A shard edited and re-hashed by hand: its checksum matches, its max_id is the old one."""
    import hashlib

    _edit_shard(tmp, world, 9000, keep_checksum=True)
    digest = hashlib.sha256((tmp / "data" / "train-00000.bin").read_bytes()).hexdigest()

    def rehash(manifest):
        manifest["splits"]["train"]["shards"][0]["sha256"] = digest
    edit_json(tmp / "data" / "manifest.json", rehash)


HELD: dict = {}  # run folder -> the RunOwner a case holds on it (released by the case's `after`)


def _hold_run_folder(run: Path) -> None:
    """Hold the folder's owner lock from this process: another open of it conflicts like another
    process."""
    from meshlm.train.ownership import RunOwner

    HELD[run] = RunOwner(run).__enter__()


def _task_run(tmp: Path) -> None:
    """A 2-step run on chase data, and dag data beside it."""
    from meshlm.train.config import TrainConfig
    from meshlm.train.trainer import train

    data, _ = make_task_data(tmp, "chase"), make_task_data(tmp, "dag")
    cfg = TrainConfig(model={"preset": "tiny", "vocab_size": 64}, data=str(data), out_dir=str(tmp),
                      name="chase-run",
                      global_batch=4, micro_batch=4, steps=2, eval_every=0, eval_windows=4,
                      save_every=2,
                      progress=False, tensorboard=False, peak_flops=1e11)
    train(cfg, log=lambda message: None)


def _other_tokenizer(tmp: Path, world) -> None:
    """{tmp}/small.json: a 270-id BPE (fits the 8,192-id model, encodes nothing like its
    tokenizer)."""
    from meshlm.data.tokenizer import train_bpe

    train_bpe(["hello world, hello there"] * 10, vocab_size=270).save(str(tmp / "small.json"))


def _data_of_other_tokenizer(tmp: Path, world) -> None:
    """{tmp}/small.json and {tmp}/small-data, the corpus prepared with it."""
    from meshlm.data.prepare import prepare

    _other_tokenizer(tmp, world)
    prepare(sorted(world["corpus"].glob("*.txt")), tmp / "small-data", str(tmp / "small.json"),
            val_fraction=0.2,
            progress=False)


def _reexported_tokenizer(tmp: Path, world) -> None:
    """{tmp}/copy.json: the run's tokenizer saved again by the library (other bytes, the same
    ids)."""
    from meshlm.data.tokenizer import load_tokenizer

    load_tokenizer("default").hf.save(str(tmp / "copy.json"), pretty=False)
def _chat_data(tmp: Path) -> None:
    """Two chat records, and a template that raises (as templates do for turns they do not
    support)."""
    record = {"messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "hello"}]}
    write(tmp / "chat.jsonl", (json.dumps(record) + "\n") * 2)
    write(tmp / "t.jinja", "{{ raise_exception('only user turns here') }}")


def _bin(tmp: Path, world) -> None:
    write(tmp / "blob.txt", bytes(range(256)) * 64)


def _latin(tmp: Path, world) -> None:
    write(tmp / "noise.txt", bytes([0xE9, 0xFF, 0x41, 0xC3]) * 2000)


EARLIER = "an earlier result\n"


def _earlier_result(path: str) -> Callable[[Path, dict], None]:
    return lambda tmp, world: write(tmp / path, EARLIER)


def _earlier_result_kept(path: str) -> Callable[[Path], None]:
    def check(tmp: Path) -> None:
        assert (tmp / path).read_text() == EARLIER
        assert not [p for p in tmp.rglob(".*") if p.name.endswith((".tmp", ".partial"))]
    return check


NOTES = "a user's notes\n"


def _notes(tmp: Path, world) -> None:
    """{tmp}/notes: a folder of someone else's files, which no command may write over."""
    write(tmp / "notes" / "notes.txt", NOTES)


def _notes_kept(tmp: Path) -> None:
    assert [p.name for p in (tmp / "notes").iterdir()] == ["notes.txt"]
    assert (tmp / "notes" / "notes.txt").read_text() == NOTES


def _no_folder_left(path: str) -> Callable[[Path], None]:
    def check(tmp: Path) -> None:
        assert not (tmp / path).exists() and not list(tmp.glob(f".{path}.*")), list(tmp.iterdir())
    return check


def _copy_data(tmp: Path, world) -> None:
    shutil.copytree(world["data"], tmp / "data")


def _earlier_data_kept(tmp: Path) -> None:
    """{tmp}/data still holds the data prepared before, every shard matching its checksum."""
    from meshlm.data.prepare import PreparedData

    assert not list((tmp / "data").glob(".prepare-*"))
    for split in ("train", "val"):
        assert PreparedData(tmp / "data", split).num_sequences(8) > 0


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _pruned_while_hashing(mp: pytest.MonkeyPatch, tmp: Path) -> None:
    """The checkpoint folder disappears while its files are being hashed (a running training pruned
    it)."""
    def prune_then_hash(path):
        shutil.rmtree(step_dir(tmp), ignore_errors=True)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
    mp.setattr("meshlm.folders.integrity.sha256_file", prune_then_hash)


# `meshlm train --resume` of the tiny run that copy_run puts under {tmp}/run: the next save is a
# checkpoint write
RESUME_COPIED_RUN = ["train", "train.data={data}", "model.preset=tiny", "model.vocab_size=8192",
                     "train.out_dir={tmp}",
                     "train.name=run", "train.seq_len=32", "train.global_batch=4",
                     "train.micro_batch=4",
                     "train.steps=4", "train.eval_windows=4", "train.progress=false",
                     "train.tensorboard=false",
                     "train.peak_flops=1e11", "--resume"]


CASES: list[Case] = [
    # -- meshlm itself
    Case("meshlm", "no command", [], 2, "the following arguments are required: COMMAND"),
    Case("meshlm", "unknown command", ["trian"], 2, "invalid choice: 'trian'"),
    # -- describe
    Case("describe", "a core run 0 times", ["describe", "--spec", "4+8R0+4"], 2,
         "needs >= 1 layer run >= 1 time"),
    Case("describe", "a spec with two parts", ["describe", "--spec", "4+8R2"], 2, "is malformed"),
    Case("describe", "an unknown scheme", ["describe", "--scheme", "meshy"], 2, "scheme='meshy'"),
    Case("describe", "an unknown preset", ["describe", "--preset", "pythia-9b"], 2,
         "unknown preset 'pythia-9b'"),
    Case("describe", "one MeSH slot", ["describe", "--slots", "1"], 2, "slots"),
    Case("describe", "a non-integer --slots", ["describe", "--slots", "four"], 2,
         "invalid int value: 'four'"),
    Case("describe", "a zero context", ["describe", "--context", "0"], 2,
         "--context 0 must be >= 1"),
    Case("describe", "three bad settings at once",
         ["describe", "--spec", "4+8R0+4", "--scheme", "x", "--slots", "1"],
         2, "scheme='x'"),
    # -- prepare
    Case("prepare", "a missing input", ["prepare", "{tmp}/nope.txt", "-o", "{tmp}/out"], 2,
         "does not exist"),
    Case("prepare", "two missing inputs",
         ["prepare", "{tmp}/a.txt", "{tmp}/b.txt", "-o", "{tmp}/out"], 2,
         "b.txt do not exist"),
    Case("prepare", "a binary file (NUL bytes)", ["prepare", "{tmp}/blob.txt", "-o", "{tmp}/out"],
         1,
         "look binary", setup=_bin, after=_no_shards_left),
    Case("prepare", "a file that is mostly not UTF-8",
         ["prepare", "{tmp}/noise.txt", "-o", "{tmp}/out"], 1,
         "are not UTF-8", setup=_latin),
    Case("prepare", "a binary file with --allow-binary",
         ["prepare", "{tmp}/blob.txt", "{corpus}", "-o", "{tmp}/out",
          "--allow-binary", "--quiet"], 0,
         "not valid UTF-8",
         setup=_bin),
    Case("prepare", "--out is a file", ["prepare", "{corpus}", "-o", "{tmp}/file"], 2, "is a file",
         setup=lambda tmp, w: write(tmp / "file", "x")),
    Case("prepare", "--out already prepared", ["prepare", "{corpus}", "-o", "{data}"], 2,
         "pass --overwrite"),
    Case("prepare", "--out holding someone else's files, with --overwrite",
         ["prepare", "{corpus}", "-o", "{tmp}/notes", "--overwrite"], 2,
         "did not write", setup=_notes, after=_notes_kept),
    Case("prepare", "--out the input folder itself", ["prepare", "{corpus}", "-o", "{corpus}",
                                                      "--overwrite"], 2,
         "is the source"),
    Case("prepare", "--val-fraction 1.5",
         ["prepare", "{corpus}", "-o", "{tmp}/out", "--val-fraction", "1.5"], 2,
         "must be in [0, 1)"),
    Case("prepare", "a tokenizer file that does not exist",
         ["prepare", "{corpus}", "-o", "{tmp}/out", "--tokenizer",
          "{tmp}/tok.json"], 2, "tok.json"),
    Case("prepare", "a tokenizer file that is not JSON",
         ["prepare", "{corpus}", "-o", "{tmp}/out", "--tokenizer",
          "{tmp}/tok.json"], 1,
         "is not a valid tokenizers JSON file",
         setup=lambda tmp, w: write(tmp / "tok.json", b"\x00\xff")),
    Case("prepare", "every input problem at once",
         ["prepare", "{tmp}/nope.txt", "-o", "{tmp}/out", "--val-fraction",
          "-1", "--shard-tokens", "0"], 2, "3 problems"),
    Case("prepare", "a JSONL line without the text field",
         ["prepare", "{tmp}/d.jsonl", "-o", "{tmp}/out"], 1,
         "has no field 'text'", setup=lambda tmp, w: write(tmp / "d.jsonl", '{"body": "hello"}\n')),
    Case("prepare", "a JSONL line that is not JSON",
         ["prepare", "{tmp}/d.jsonl", "-o", "{tmp}/out"], 1,
         "is not valid JSON",
         setup=lambda tmp, w: write(tmp / "d.jsonl", '{"text": "a"}\n{"text": \n')),
    Case("prepare", "an empty file", ["prepare", "{tmp}/empty.txt", "-o", "{tmp}/out"], 1,
         "no text found",
         setup=lambda tmp, w: write(tmp / "empty.txt", "  \n")),
    Case("prepare", "a folder without text files", ["prepare", "{tmp}/pics", "-o", "{tmp}/out"], 1,
         "holds no", setup=lambda tmp, w: write(tmp / "pics" / "a.png", b"\x89PNG")),
    Case("prepare", "a truncated .gz file", ["prepare", "{tmp}/c.txt.gz", "-o", "{tmp}/out"], 1,
         "cannot be read",
         setup=lambda tmp, w: write(tmp / "c.txt.gz", b"\x1f\x8b\x08\x00garbage")),
    Case("prepare", "one document: an empty validation split",
         ["prepare", "{corpus}/doc00.txt", "-o", "{tmp}/out",
          "--quiet"], 0,
         "the input is one document"),
    Case("prepare", "a tiny validation split",
         ["prepare", "{corpus}", "-o", "{tmp}/out", "--val-fraction", "0.01",
          "--quiet"], 0, "--val-fraction"),
    Case("prepare", "--val-fraction 0",
         ["prepare", "{corpus}", "-o", "{tmp}/out", "--val-fraction", "0",
          "--quiet"], 0, "pass --val-fraction 0.02"),
    Case("prepare", "a full disk while writing shards",
         ["prepare", "{corpus}", "-o", "{tmp}/out", "--quiet"], 1,
         "no space left on device",
         patch=lambda mp, tmp: mp.setattr("meshlm.data.shards.open", raise_oserror(errno.ENOSPC),
                                          raising=False),
         after=_no_shards_left),
    Case("prepare", "Ctrl-C while --overwrite replaces prepared data",
         ["prepare", "{corpus}", "-o", "{tmp}/data",
          "--overwrite", "--quiet"],
         130, "are kept",
         setup=_copy_data,
         patch=lambda mp, tmp: mp.setattr("meshlm.data.prepare.encode_and_write", _ctrl_c),
         after=_earlier_data_kept),
    Case("prepare", "a full disk while --overwrite replaces prepared data",
         ["prepare", "{corpus}", "-o", "{tmp}/data", "--overwrite", "--quiet"], 1,
         "no space left on device",
         setup=_copy_data,
         patch=lambda mp, tmp: mp.setattr("meshlm.data.shards.open", raise_oserror(errno.ENOSPC),
                                          raising=False),
         after=_earlier_data_kept),
    Case("prepare", "an unknown reasoning task", ["prepare", "task:sudoku", "-o", "{tmp}/out"], 2,
         "unknown reasoning task sudoku"),
    Case("prepare", "a difficulty the task cannot make",
         ["prepare", "task:chase", "-o", "{tmp}/out",
          "--test-difficulty", "1-30"], 2,
         "outside what task chase makes (1-8)"),
    Case("prepare", "labelled and answer-only tasks in one folder",
         ["prepare", "task:chain,chase", "-o", "{tmp}/out"], 2,
         "mix labelled tasks (chain) with answer-only ones"),
    Case("prepare", "a labelled task's size knob out of range",
         ["prepare", "task:chain", "-o", "{tmp}/out", "--task-option", "chain.cells=40"], 2,
         "need 2 <= cells <= 26"),
    Case("prepare", "test difficulties overlapping training ones, asked disjoint",
         ["prepare", "task:chase", "-o", "{tmp}/out", "--train-difficulty", "1-4",
          "--test-difficulty", "3-8",
          "--disjoint"], 2, "overlap the training difficulties 1-4"),
    # -- train
    Case("train", "a run folder another training holds",
         ["train", "train.data={data}", "model.preset=tiny",
          "model.vocab_size=8192",
          "train.out_dir={tmp}",
          "train.name=run", "train.seq_len=32"], 2,
         "is in use by PID", setup=lambda tmp, world: _hold_run_folder(tmp / "run"),
         after=lambda tmp: HELD.pop(tmp / "run").__exit__(None, None, None)),
    Case("train", "a shard changed in place (same size, ids still in the vocabulary)",
         ["train", "train.data={tmp}/data", "model.preset=tiny", "model.vocab_size=8192",
          "train.seq_len=32"], 1,
         "does not match its checksum",
         setup=lambda tmp, world: _edit_shard(tmp, world, 7, keep_checksum=True)),
    Case("train", "an id beyond the vocabulary in data without checksums",
         ["train", "train.data={tmp}/data", "model.preset=tiny", "model.vocab_size=8192",
          "train.seq_len=32"], 1,
         "holds token id 9,000, but the model's vocabulary has 8,192 ids",
         setup=lambda tmp, world: _edit_shard(tmp, world, 9000, keep_checksum=False)),
    Case("train", "a shard re-hashed with a stale max_id",
         ["train", "train.data={tmp}/data", "model.preset=tiny", "model.vocab_size=8192",
          "train.seq_len=32", "train.steps=400", "train.out_dir={tmp}"], 1,
         "the manifest is stale", setup=_stale_max_id),
    Case("train", "a seq_len that cuts task examples",
         ["train", "train.data={tmp}/chase", "model.vocab_size=64",
          "train.seq_len=20"], 2,
         "set train.seq_len=52 (or 0)", setup=lambda tmp, world: make_task_data(tmp, "chase")),
    Case("train", "seq_len above the context",
         ["train", "train.data={data}", "model.preset=tiny", "seq_len=512"], 2,
         "exceeds the model's context_length"),
    Case("train", "a curriculum over data that are not task data",
         ["train", "train.data={data}", "model.preset=tiny", "model.vocab_size=8192",
          "train.seq_len=32", "train.curriculum=5", "train.out_dir={tmp}"], 2,
         "train.curriculum needs task data"),
    Case("train", "next-token targets for unlabelled positions of data without labels",
         ["train", "train.data={data}", "model.preset=tiny", "model.vocab_size=8192",
          "train.seq_len=32", "train.unlabelled=next", "train.out_dir={tmp}"], 2,
         "train.unlabelled=next gives the positions without a label their next token"),
    Case("train", "a delayed reveal on data without labels",
         ["train", "train.data={data}", "model.preset=tiny", "model.vocab_size=8192",
          "model.scheme=anchor", "train.seq_len=32", "train.reveal=2", "train.out_dir={tmp}"], 2,
         "train.reveal=2 hides the given values of labelled task data, but"),
    Case("train", "a delayed reveal with a scheme that reads its input only before the loop",
         ["train", "train.data={tmp}/chain", "model.preset=tiny", "model.vocab_size=48",
          "model.scheme=base", "train.reveal=2", "train.out_dir={tmp}/runs"], 2,
         "train.reveal=2 needs a scheme that re-injects its input at every loop step",
         setup=lambda tmp, world: make_task_data(tmp, "chain")),
    Case("train", "a vocabulary smaller than the tokenizer's",
         ["train", "train.data={data}", "model.vocab_size=1000"],
         2, "set the model vocab_size to at least 8192"),
    Case("train", "data that does not exist", ["train", "train.data={tmp}/nodata"], 2,
         "does not exist"),
    Case("train", "a run name that climbs out of out_dir", ["train", "train.name=.."], 2,
         "name='..' must be one folder name"),
    Case("train", "an out_dir that is a file",
         ["train", "train.data={data}", "train.out_dir={tmp}/file"], 2,
         "is a file, not a folder", setup=lambda tmp, w: write(tmp / "file", "x")),
    Case("train", "an empty validation split",
         ["train", "train.data={tmp}/out", "model.preset=tiny",
          "model.vocab_size=8192", "train.seq_len=32"], 1,
         "is empty; prepare the data again with --val-fraction 0.02",
         setup=lambda tmp, w: _prepare_without_validation(tmp, w)),
    Case("train", "neither steps nor tokens", ["train", "steps=0", "tokens=0"], 2,
         "set steps or tokens"),
    Case("train", "an override without =", ["train", "not-an-override"], 2, "not key=value"),
    Case("train", "a boolean given as 1", ["train", "train.progress=1"], 2,
         "progress=1 must be true or false"),
    Case("train", "a float that does not parse", ["train", "train.lr=fast"], 2,
         "lr='fast' must be a finite number"),
    Case("train", "a model boolean given as 2", ["train", "model.tie_embeddings=2"], 2,
         "tie_embeddings=2 must be"),
    Case("train", "a fractional step count", ["train", "train.steps=1.5"], 2,
         "steps=1.5 must be an integer"),
    Case("train", "five bad fields at once",
         ["train", "train.progress=1", "train.lr=fast", "model.d_model=x",
          "model.n_heads=0", "train.micro_batch=0"], 2,
         "micro_batch=0"),
    Case("train", "an unknown field", ["train", "train.lrr=1e-3"], 2,
         "unknown train field(s) ['lrr']"),
    Case("train", "the old eval_batches", ["train", "train.eval_batches=16"], 2,
         "replaced by eval_windows"),
    Case("train", "a nested override into a number", ["train", "model.d_model.x=1"], 2,
         "must be an integer"),
    Case("train", "a missing config file", ["train", "--config", "{tmp}/nope.yaml"], 2,
         "does not exist"),
    Case("train", "a config file that is not YAML", ["train", "--config", "{tmp}/c.yaml"], 2,
         "is not valid YAML",
         setup=lambda tmp, w: write(tmp / "c.yaml", "model: [unclosed\n")),
    Case("train", "a config section given twice", ["train", "--config", "{tmp}/c.yaml"], 2,
         "key 'train' appears twice (lines 1 and 3); keep one",
         setup=lambda tmp, w: write(tmp / "c.yaml", "train:\n  lr: 1.0e-3\ntrain:\n  steps: 10\n")),
    Case("reproduce", "a study file naming a variant twice",
         ["reproduce", "{tmp}/s.yaml", "--plan"], 2,
         "key 'a' appears twice",
         setup=lambda tmp, w: write(tmp / "s.yaml", "variants:\n  a: {}\n  a: {}\n")),
    Case("train", "a model section that is not a mapping", ["train", "--config", "{tmp}/c.yaml"], 2,
         "section must be a mapping", setup=lambda tmp, w: write(tmp / "c.yaml", "model: tiny\n")),
    Case("train", "a run that already has checkpoints",
         ["train", "train.data={data}", "model.preset=tiny",
          "model.vocab_size=8192",
          "train.out_dir={tmp}",
          "train.name=run"], 2, "pass --resume",
         setup=lambda tmp, w: copy_run(tmp, w)),
    Case("train", "--resume when every checkpoint is corrupt",
         ["train", "train.data={data}", "model.preset=tiny",
          "model.vocab_size=8192",
          "train.out_dir={tmp}",
          "train.name=run", "--resume"], 1,
         "no usable checkpoint",
         setup=lambda tmp, w: (copy_run(tmp, w), write(step_dir(tmp) / "state.pt", b"garbage"))),
    Case("train", "train.tokenizer unlike init_from's", ["train", "train.init_from={run}",
                                                        "train.data={tmp}/small-data",
                                                        "train.tokenizer={tmp}/small.json"], 2,
         "does not encode like", setup=_data_of_other_tokenizer),
    Case("train", "a model whose training cannot fit the free memory",
         ["train", "train.data={data}", "model.preset=tiny", "model.vocab_size=8192",
          "model.d_model=4096",
          "model.n_heads=32", "train.seq_len=32"], 2,
         "training needs about",
         patch=lambda mp, tmp: mp.setattr("meshlm.train.footprint.available_bytes",
                                          lambda device: (8e9, "this "
                                                          "machine "
                                                          "has"))),
    Case("train", "train.steps=1e12 (the warmup alone is 1e10 steps)",
         ["train", "train.data={data}",
          "model.preset=tiny",
          "model.vocab_size=8192",
          "train.seq_len=32",
          "train.steps=1e12",
          "train.out_dir={tmp}"], 2,
         "training windows"),
    Case("train", "save_every beyond the run's steps",
         ["train", "train.data={data}", "model.preset=tiny",
          "model.vocab_size=8192", "train.seq_len=32",
          "train.steps=2",
          "train.save_every=5", "train.eval_every=0",
          "train.eval_windows=4",
          "train.global_batch=4",
          "train.micro_batch=4",
          "train.out_dir={tmp}",
          "train.progress=false",
          "train.tensorboard=false",
          "train.peak_flops=1e11"], 0,
         "save_every=5 exceeds"),
    Case("train", "init_from a folder that does not exist, with a preset",
         ["train", "model.preset=tiny",
          "train.init_from={tmp}/nope"], 2,
         "is not a directory"),
    Case("train", "--resume with a changed train.loops",
         [*RESUME_COPIED_RUN[:-1], "train.loops=uniform:1-3", "--resume"], 1,
         "model.max_loops follows train.loops",
         setup=lambda tmp, w: copy_run(tmp, w)),
    Case("train", "an unavailable device", ["train", "train.device=cuda"], 2,
         "no CUDA device is visible",
         patch=no_cuda),
    Case("train", "a device that does not exist", ["train", "train.device=tpu"], 2,
         "must be auto, cpu or cuda"),
    Case("train", "init_from a folder that is not a checkpoint", ["train", "train.init_from={tmp}"],
         2,
         "train.init_from"),
    Case("train", "a scheme option of the wrong type", ["train", "model.scheme_options.slots=abc"],
         2,
         "slots='abc'"),
    Case("train", "a full disk at a checkpoint", RESUME_COPIED_RUN, 1,
         "no space left on device", setup=lambda tmp, w: copy_run(tmp, w),
         patch=lambda mp, tmp: mp.setattr("meshlm.checkpoint.save_file",
                                          raise_oserror(errno.ENOSPC)),
         after=_earlier_checkpoint_intact),
    Case("train", "a full disk under metrics.jsonl", RESUME_COPIED_RUN, 1,
         "metrics.jsonl: no space left on device", setup=lambda tmp, w: copy_run(tmp, w),
         patch=lambda mp, tmp: mp.setattr("meshlm.train.monitor.open", raise_oserror(errno.ENOSPC),
                                          raising=False)),
    Case("train", "a full disk under the TensorBoard events (written from a thread)",
         [a.replace("tensorboard=false", "tensorboard=true") for a in RESUME_COPIED_RUN], 1,
         "tensorboard: no space left on device",
         setup=lambda tmp, w: copy_run(tmp, w),
         patch=lambda mp, tmp: mp.setattr(
             "tensorboard.summary.writer.record_writer.RecordWriter.write",
                                          raise_oserror(errno.ENOSPC))),
    Case("train", "a read-only run folder", RESUME_COPIED_RUN, 1,
         "read-only file system", setup=lambda tmp, w: copy_run(tmp, w),
         patch=lambda mp, tmp: mp.setattr("meshlm.checkpoint.torch.save",
                                          raise_oserror(errno.EROFS)),
         after=_earlier_checkpoint_intact),
    Case("train", "a run folder that cannot be written (found before training)",
         ["train", "train.data={data}", "train.out_dir={tmp}/ro"], 2, "cannot write to",
         patch=lambda mp, tmp: mp.setattr("meshlm.errors.os.access", lambda path, mode: False)),
    Case("train", "a rank stopped (SIGSTOP) under torchrun", ["train"], 1,
         "is stopped (SIGSTOP or a debugger)",
         runner=rank_fault_runner("stopped"), slow=True),
    Case("train", "a rank killed under torchrun", ["train"], 1, "has exited (killed or crashed)",
         runner=rank_fault_runner("killed"), slow=True),
    Case("train", "Ctrl-C", ["train"], 130, "--resume", runner=signal_runner([signal.SIGINT]),
         slow=True),
    Case("train", "SIGTERM", ["train"], 143, "--resume", runner=signal_runner([signal.SIGTERM]),
         slow=True),
    Case("train", "Ctrl-C twice", ["train"], 130, "interrupted",
         runner=signal_runner([signal.SIGINT, signal.SIGINT]), slow=True),
    # -- finetune
    Case("finetune", "a record without prompt/completion or messages",
         ["finetune", "{run}", "{tmp}/bad.jsonl"], 1,
         "needs string fields \"prompt\" and \"completion\", or \"messages\"",
         setup=lambda tmp, world: write(tmp / "bad.jsonl",
                                        '{"prompt": "a", "completion": "b"}\n{"text": "c"}\n'),
         patch=empty_cache),
    Case("finetune", "labelled task data instead of records",
         ["finetune", "{run}", "{tmp}/chain"], 1,
         "is a prepared folder (labelled task data), which fine-tuning cannot use",
         setup=lambda tmp, world: make_task_data(tmp, "chain"), patch=empty_cache),
    Case("finetune", "a chat template that fails to render",
         ["finetune", "{run}", "{tmp}/chat.jsonl",
          "--chat-template", "{tmp}/t.jinja"],
         1,
         "the chat template failed to render", setup=lambda tmp, world: _chat_data(tmp),
         patch=empty_cache),
    Case("finetune", "LoRA targets that match nothing", ["finetune", "{run}", "{tmp}/chat.jsonl",
                                                         "train.lora_targets=nothing_like_this"], 2,
         "matches no Linear", setup=lambda tmp, world: _chat_data(tmp), patch=empty_cache),
    Case("finetune", "a LoRA rank below 0",
         ["finetune", "{run}", "{tmp}/chat.jsonl", "train.lora_rank=-1"], 2,
         "lora_rank=-1 must be >= 1", setup=lambda tmp, world: _chat_data(tmp), patch=empty_cache),
    Case("finetune", "a LoRA rank as wide as the layers it adapts",
         ["finetune", "{run}", "{tmp}/chat.jsonl", "train.lora_rank=100000"], 2,
         "pass train.lora_rank=63 or less", setup=lambda tmp, world: _chat_data(tmp),
         patch=empty_cache),
    Case("finetune", "a run folder of someone else's files",
         ["finetune", "{run}", "{tmp}/chat.jsonl", "train.out_dir={tmp}", "train.name=notes"], 2,
         "no meshlm training wrote",
         setup=lambda tmp, world: (_chat_data(tmp), _notes(tmp, world)), patch=empty_cache,
         after=_notes_kept),
    Case("describe", "per-loop LoRA without a shared core",
         ["describe", "--spec", "2+4+2", "--scheme", "base",
          "--loop-lora-rank", "4"], 2,
         "needs a shared core"),
    # -- generate
    Case("generate", "no prompt", ["generate", "{run}"], 2, "pass the text to continue"),
    Case("generate", "an empty prompt", ["generate", "{run}", ""], 2, "prompt 1 is empty"),
    Case("generate", "a prompt longer than the context", ["generate", "{run}", "word " * 200], 2,
         "shorten the prompt"),
    Case("generate", "a prompt plus -n beyond the context",
         ["generate", "{run}", "word " * 100, "-n", "50"], 2,
         "pass -n 27 or less"),
    Case("generate", "--top-p 1.5", ["generate", "{run}", "hi", "--top-p", "1.5"], 2,
         "top_p=1.5 must be in (0, 1]"),
    Case("generate", "a negative temperature", ["generate", "{run}", "hi", "-t", "-1"], 2,
         "temperature=-1.0"),
    Case("generate", "--loops 0", ["generate", "{run}", "hi", "--loops", "0"], 2,
         "--loops 0 must be >= 1"),
    Case("generate", "--loops past the cap", ["generate", "{run}", "hi", "--loops", "10000"], 2,
         "at most 8: 4x the trained 2"),
    Case("generate", "--compile with --no-cache", ["generate", "{run}", "hi", "--compile",
                                                   "--no-cache"], 2,
         "--compile decodes with the KV cache"),
    Case("generate", "--aot with --exit", ["generate", "{run}", "hi", "--aot", "--exit",
                                           "state:0.1"], 2,
         "use --compile with --exit or --speculate"),
    Case("generate", "a seed beyond 64 bits",
         ["generate", "{run}", "hi", "--seed", "1180591620717411303424"], 2,
         "must be a 64-bit integer"),
    Case("generate", "a checkpoint folder that does not exist", ["generate", "{tmp}/nope", "hi"], 2,
         "is not a folder"),
    Case("generate", "an unavailable device", ["generate", "{run}", "hi", "--device", "cuda"], 2,
         "no CUDA device is visible", patch=no_cuda),
    Case("generate", "three problems at once", ["generate", "{tmp}/nope", "", "--top-p", "0"], 2,
         "3 problems"),
    # -- serve
    Case("serve", "a model folder that does not exist", ["serve", "{tmp}/nope"], 2,
         "is not a folder"),
    Case("serve", "--max-batch 0", ["serve", "{run}", "--max-batch", "0"], 2,
         "--max-batch 0 must be >= 1"),
    Case("serve", "--max-loops 0", ["serve", "{run}", "--max-loops", "0"], 2,
         "--max-loops 0 must be >= 1"),
    Case("serve", "a negative loop slice", ["serve", "{run}", "--loop-slice", "-1"], 2,
         "--loop-slice -1 must be >= 0"),
    Case("serve", "a port out of range", ["serve", "{run}", "--port", "70000"], 2,
         "--port 70000 must be in"),
    Case("serve", "a negative prefill chunk", ["serve", "{run}", "--prefill-chunk", "-1"], 2,
         "--prefill-chunk -1 must be >= 0"),
    Case("serve", "an unavailable device", ["serve", "{run}", "--device", "cuda"], 2,
         "no CUDA device is visible", patch=no_cuda),
    Case("serve", "three problems at once",
         ["serve", "{tmp}/nope", "--timeout", "0", "--max-queue", "-1"], 2,
         "3 problems"),
    Case("generate", "a checkpoint whose config.json was edited", ["generate", "{tmp}/run", "hi"],
         1,
         "config.json was edited",
         setup=lambda tmp, w: (copy_run(tmp, w),
                               edit_json(step_dir(tmp) / "config.json",
                                         lambda d: d["model"].update(d_model=96)))),
    Case("generate", "a checkpoint without manifest.json", ["generate", "{tmp}/run", "hi"], 1,
         "manifest.json is missing",
         setup=lambda tmp, w: (copy_run(tmp, w), (step_dir(tmp) / "manifest.json").unlink())),
    Case("generate", "a hand-edited manifest.json", ["generate", "{tmp}/run", "hi"], 1,
         "was edited or is corrupt",
         setup=lambda tmp, w: (copy_run(tmp, w), edit_json(step_dir(tmp) / "manifest.json",
                                                          lambda d: d[
                                                               "files"][
                                                               "config.json"].update(bytes=1)))),
    Case("generate", "a manifest that leaves out state.pt", ["generate", "{tmp}/run", "hi"], 1,
         "does not cover",
         setup=lambda tmp, w: (copy_run(tmp, w), _drop_from_manifest(step_dir(tmp), "state.pt"))),
    Case("generate", "--tokenizer: the checkpoint's, exported again (other bytes, same ids)",
         ["generate", "{run}", "hi", "-n", "2", "-t", "0", "--tokenizer", "{tmp}/copy.json"], 0, "",
         setup=_reexported_tokenizer),
    Case("generate", "--tokenizer unlike the checkpoint's, forced",
         ["generate", "{run}", "hi", "-n", "2", "-t", "0",
          "--tokenizer",
          "{tmp}/small.json",
          "--force-tokenizer"], 0, "",
         setup=_other_tokenizer),
    Case("generate", "a checkpoint pruned while being read",
         ["generate", "{tmp}/run/step-000002", "hi"], 1,
         "was removed while being read", setup=lambda tmp, w: copy_run(tmp, w),
         patch=_pruned_while_hashing),
    Case("generate", "a damaged optimizer state, which generate never reads",
         ["generate", "{tmp}/run", "hi", "-n",
          "2", "-t", "0"], 0,
         "",
         setup=lambda tmp, w: (copy_run(tmp, w), _flip_byte(step_dir(tmp) / "state.pt"))),
    Case("generate", "a prompt that is not UTF-8 (any shell bytes)",
         ["generate", "{run}", "caf\udce9 \udcff",
          "-n", "2", "-t", "0"], 0, ""),
    # -- eval
    Case("eval", "an unknown task", ["eval", "{run}", "--tasks", "piqa,nope"], 2,
         "unknown task(s) ['nope']"),
    Case("eval", "tasks whose data were never fetched", ["eval", "{run}", "--tasks", "piqa"], 1,
         "meshlm fetch",
         patch=empty_cache),
    Case("eval", "--limit 0", ["eval", "{run}", "--limit", "0"], 2, "--limit 0 must be >= 1"),
    Case("eval", "--out naming a folder", ["eval", "{run}", "--out", "{tmp}", "--tasks", "none"], 2,
         "is a folder; name the JSON file to write"),
    Case("eval", "a task checkpoint on another task's data",
         ["eval", "{tmp}/chase-run", "--data", "{tmp}/dag"], 2,
         "was trained on task(s) chase", setup=lambda tmp, world: _task_run(tmp)),
    Case("eval", "the reasoning suite on text data",
         ["eval", "{run}", "--suite", "reasoning", "--loops", "none"], 2,
         "--suite reasoning needs task data"),
    Case("eval", "--loops 0", ["eval", "{run}", "--loops", "0,2"], 2, "loop counts must be >= 1"),
    Case("eval", "--shots that are not numbers", ["eval", "{run}", "--shots", "zero"], 2,
         "is not a comma-separated list of integers"),
    Case("eval", "an unavailable device", ["eval", "{run}", "--device", "cuda"], 2,
         "no CUDA device is visible",
         patch=no_cuda),
    Case("eval", "a checkpoint folder that does not exist", ["eval", "{tmp}/nope"], 2,
         "does not exist"),
    Case("eval", "a folder with no checkpoint", ["eval", "{tmp}"], 1, "has no config.json"),
    Case("eval", "an output folder that cannot be written (found before perplexity)",
         ["eval", "{run}"], 2,
         "cannot write to",
         patch=lambda mp, tmp: mp.setattr("meshlm.errors.os.access", lambda path, mode: False)),
    Case("eval", "--data that does not exist", ["eval", "{run}", "--data", "{tmp}/nodata"], 2,
         "does not exist"),
    Case("eval", "four problems at once",
         ["eval", "{tmp}/nope", "--tasks", "nope", "--limit", "0", "--device",
          "cuda"], 2, "4 problems", patch=no_cuda),
    Case("eval", "a corrupt weights file", ["eval", "{tmp}/run", "--tasks", "none"], 1,
         "truncated or corrupt",
         setup=lambda tmp, w: (copy_run(tmp, w), _truncate(step_dir(tmp) / "model.safetensors"))),
    Case("eval", "Ctrl-C during the tasks, after perplexity",
         ["eval", "{tmp}/run", "--tasks", "piqa", "--shots",
          "0", "--limit", "2"], 130, "are kept",
         setup=lambda tmp, w: copy_run(tmp, w),
         patch=lambda mp, tmp: (mp.setattr("meshlm.commands.eval.check_tasks",
                                           lambda tasks, p, *rest: None),
                                mp.setattr("meshlm.evaluation.run.downstream", _ctrl_c)),
         after=_partial_eval_kept),
    Case("eval", "--tokenizer that encodes unlike the checkpoint's",
         ["eval", "{run}", "--tokenizer",
          "{tmp}/small.json", "--tasks",
          "none"], 2,
         "does not encode like", setup=_other_tokenizer),
    # -- probe
    Case("probe", "--samples 0", ["probe", "{run}", "--samples", "0"], 2,
         "--samples and --batch-size must be >= 1"),
    Case("probe", "--tokens 1", ["probe", "{run}", "--tokens", "1"], 2, "--tokens 1 must be >= 2"),
    Case("probe", "an unknown split", ["probe", "{run}", "--split", "test"], 2,
         "must be train or val"),
    Case("probe", "--tokens beyond the context", ["probe", "{run}", "--tokens", "4096"], 2,
         "exceeds the model's context_length"),
    Case("probe", "a checkpoint folder that does not exist", ["probe", "{tmp}/nope"], 2,
         "does not exist"),
    Case("probe", "an output folder on a full disk (found before probing)",
         ["probe", "{run}", "--out", "{tmp}/p"], 2,
         "no space left on device",
         patch=lambda mp, tmp: mp.setattr("meshlm.errors.shutil.disk_usage",
                                          lambda path: shutil._ntuple_diskusage(1, 1, 0))),
    Case("probe", "an earlier probe in place, without --overwrite", ["probe", "{tmp}/run"], 2,
         "pass --overwrite",
         setup=lambda tmp, w: (copy_run(tmp, w), write(tmp / "run" / "probe" / "probe.json",
                                                       EARLIER)),
         after=_earlier_result_kept("run/probe/probe.json")),
    Case("eval", "an output folder on a full disk (found before perplexity)",
         ["eval", "{run}", "--out",
          "{tmp}/e.json"], 2,
         "no space left on device",
         patch=lambda mp, tmp: mp.setattr("meshlm.errors.shutil.disk_usage",
                                          lambda path: shutil._ntuple_diskusage(1, 1, 0))),
    # -- convert / retrofit
    Case("convert", "a source that does not exist", ["convert", "{tmp}/nope", "{tmp}/out"], 2,
         "does not exist"),
    Case("convert", "an output folder that is not empty",
         ["convert", "{run}", "{corpus}", "--to", "hf"], 2,
         "did not write"),
    Case("convert", "the source as its own output, with --overwrite",
         ["convert", "{run}", "{run}", "--to", "hf", "--overwrite"], 2,
         "is the source"),
    Case("convert", "a MeSH model to GPT-NeoX", ["convert", "{run}", "{tmp}/out", "--to", "neox"],
         2,
         "only a vanilla model converts"),
    Case("convert", "a folder of another model type", ["convert", "{tmp}/bert", "{tmp}/out"], 1,
         "model_type 'bert'",
         setup=lambda tmp, w: write(tmp / "bert" / "config.json", '{"model_type": "bert"}')),
    Case("convert", "a full disk while exporting to Hugging Face",
         ["convert", "{run}", "{tmp}/out", "--to", "hf"], 1,
         "no space left on device", patch=full_disk, after=_no_folder_left("out")),
    # -- quantize
    Case("quantize", "int4 groups that do not divide a layer's input",
         ["quantize", "{run}", "--bits", "4", "--group-size", "256"], 2,
         "does not divide the input width"),
    Case("quantize", "an unknown part", ["quantize", "{run}", "--bits", "8", "--parts", "body"], 2,
         "unknown ['body']"),
    Case("quantize", "a checkpoint that is already quantized",
         ["quantize", "{tmp}/run/int8", "--bits", "8"], 2,
         "is quantized already",
         setup=lambda tmp, w: quantized_copy(tmp, w)),
    Case("quantize", "--out the run itself, with --overwrite",
         ["quantize", "{tmp}/run", "--bits", "8", "--out", "{tmp}/run", "--overwrite"], 2,
         "is the source", setup=lambda tmp, w: copy_run(tmp, w),
         after=_earlier_checkpoint_intact),
    Case("quantize", "--out holding someone else's files, with --overwrite",
         ["quantize", "{run}", "--bits", "8", "--out", "{tmp}/notes", "--overwrite"], 2,
         "did not write", setup=_notes, after=_notes_kept),
    Case("quantize", "an earlier quantized checkpoint in place, without --overwrite",
         ["quantize", "{tmp}/run", "--bits", "8", "--activations", "bf16"], 2,
         "pass --overwrite", setup=lambda tmp, w: quantized_copy(tmp, w)),
    Case("quantize", "--out under /proc", ["quantize", "{run}", "--bits", "8", "--out", "/proc/q"],
         2,
         "not a place files can be created"),
    Case("retrofit", "--scheme-options that are not JSON",
         ["retrofit", "{run}", "{tmp}/out", "--spec", "1+1R2+1",
          "--scheme-options", "slots=4"], 2,
         "is not JSON"),
    Case("retrofit", "a source that does not exist",
         ["retrofit", "{tmp}/nope", "{tmp}/out", "--spec", "2+2R2+2"], 2,
         "does not exist"),
    Case("retrofit", "a looped source", ["retrofit", "{run}", "{tmp}/out", "--spec", "1+1R2+1"], 2,
         "vanilla"),
    Case("retrofit", "an output folder of someone else's files",
         ["retrofit", "{run}", "{tmp}/notes", "--spec", "1+1R2+1", "--overwrite"], 2,
         "did not write", setup=_notes, after=_notes_kept),
    # -- report / reproduce / fetch
    Case("report", "a run with nothing to report", ["report", "{tmp}"], 1, "has no eval.json"),
    Case("report", "an output folder that cannot be written",
         ["report", "{run}", "--out", "{tmp}/r.html"], 1,
         "permission denied",
         patch=lambda mp, tmp: mp.setattr("meshlm.analysis.report.Path.write_text",
                                          raise_oserror(errno.EACCES))),
    Case("report", "a full disk, an earlier report in place",
         ["report", "{run}", "--out", "{tmp}/r.html"], 1,
         "no space left on device", setup=_earlier_result("r.html"), patch=full_disk,
         after=_earlier_result_kept("r.html")),
    Case("report", "--figures into a folder of someone else's files",
         ["report", "{run}", "--figures", "{tmp}/notes", "--overwrite"], 2,
         "did not write", setup=_notes, after=_notes_kept),
    Case("tasks", "an export into a folder of someone else's files",
         ["tasks", "export", "{tmp}/notes", "--overwrite"], 2,
         "did not write", setup=_notes, after=_notes_kept),
    Case("reproduce", "neither a study nor --quick", ["reproduce"], 2,
         "pass a study file or --quick"),
    Case("reproduce", "a study file that does not exist", ["reproduce", "{tmp}/nope.yaml"], 2,
         "nope.yaml"),
    Case("reproduce", "an override without =", ["reproduce", "--quick", "--plan", "train.lr=fast"],
         2,
         "lr='fast' must be a finite number"),
    Case("reproduce", "a study file that is not YAML", ["reproduce", "{tmp}/s.yaml"], 2,
         "is not valid YAML",
         setup=lambda tmp, w: write(tmp / "s.yaml", "variants: [\n")),
    Case("reproduce", "a variant starting from one the study lacks",
         ["reproduce", "{tmp}/s.yaml", "--plan"], 2,
         "`from: b` names no variant of this study",
         setup=lambda tmp, w: write(tmp / "s.yaml", "variants:\n  a: {from: b}\n")),
    Case("fetch", "a cache folder that is a file", ["fetch", "--cache-dir", "{tmp}/file"], 2,
         "is a file",
         setup=lambda tmp, w: write(tmp / "file", "x")),
]


def _ctrl_c(*args, **kwargs):
    raise KeyboardInterrupt


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _drop_from_manifest(folder: Path, name: str) -> None:
    from meshlm.folders.integrity import digest

    def change(d: dict) -> None:
        del d["files"][name]
        d["sha256"] = digest(d["files"])
    edit_json(folder / "manifest.json", change)


for _i, _case in enumerate(CASES):
    _case.id = f"{_case.command}-{_i:02d}"


# -- running a case --------------------------------------------------------------------------------
def fill(arg: str, tmp: Path, world: dict[str, Path]) -> str:
    return arg.format(tmp=tmp, ckpt=step_dir(tmp), **world)


def run_case(case: Case, tmp: Path, world: dict[str, Path]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the case, run in this process (main()) unless it has its own
    runner."""
    from meshlm.cli import main

    if case.setup:
        case.setup(tmp, world)
    if case.runner:
        return case.runner(tmp, world)
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MESHLM_DEBUG", "")
        mp.chdir(tmp)
        if case.patch:
            case.patch(mp, tmp)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([fill(a, tmp, world) for a in case.argv])
            except SystemExit as stop:  # argparse usage errors
                code = stop.code
    return code, out.getvalue(), err.getvalue()


def message(case: Case, err: str) -> str:
    """The line the user sees: the error line, or for a success the line holding the needle ("" if
    none)."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    if case.code == 0:
        return next((line for line in lines if case.needle and case.needle in line), "")
    return lines[-1] if lines else ""


def normalise(text: str, tmp: Path, world: dict[str, Path]) -> str:
    for name, path in sorted(world.items(), key=lambda kv: -len(str(kv[1]))):
        text = text.replace(str(path), f"<{name}>")
    text = text.replace(str(tmp), "<tmp>")
    # where the package lies differs between checkouts
    text = text.replace(str(SHIPPED_CONFIGS), "<configs>")
    text = re.sub(r"\d+(\.\d+)? [KMGT]?B free", "N GB free", text)
    text = re.sub(r"<tmp>/runs/run/step-\d+", "<tmp>/runs/run/step-N", text)
    text = re.sub(r"holds step \d+/500", "holds step N/500", text)
    text = re.sub(r"\(PID \d+ on \S+, at step \d+\)", "(PID N on HOST, at step N)", text)
    text = re.sub(r"in use by PID \d+ on \S+ \(started [^)]*\)",
                  "in use by PID N on HOST (started TIME: COMMAND)",
                  # the holder is this test process: its command line depends on how pytest was run
                  text)
    return text


def row(case: Case, text: str) -> str:
    cell = text.replace("|", "\\|") if text else "(no error: works)"
    return f"| {case.command} | {case.what} | {case.code} | `{cell}` |"


HEADER = """# Errors: what each bad input gets

Generated by `scripts/errors_table.py` from the cases in `tests/faultkit.py`; `tests/test_faults.py`
checks every row against what the command really prints, so the table cannot drift. Each failure is
one line on stderr (argparse usage errors print the usage block first) with no traceback; `--debug`
or `MESHLM_DEBUG=1` adds the traceback. Exit codes: 2 usage (a bad argument or config value), 1
runtime (data, checkpoint, filesystem), 130 Ctrl-C, 143 SIGTERM, 0 for the inputs that are handled
(a warning or a correct result). Paths: `<tmp>` is the working folder, `<run>` a trained run,
`<data>` prepared data, `<corpus>` text files, `<configs>` the shipped configs.

| command | bad input or fault | exit | message |
|---|---|---|---|
"""


def table(rows: list[str]) -> str:
    return HEADER + "\n".join(rows) + f"\n\n{len(rows)} cases.\n"
