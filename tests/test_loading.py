"""meshlm.loading: every model folder opens through one function, with one tokenizer rule and one
data rule.

The regression at the heart of it: a run trained with `train.init_from` from a Hugging Face folder
that has its own tokenizer (more than the default's 8,192 ids) must be evaluated and probed with
that tokenizer, not with meshlm's default one (whose smaller vocabulary would pass the vocabulary
check).
"""
from __future__ import annotations

import collections
import itertools
import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer
from trainkit import tiny_train

from meshlm import checkpoint
from meshlm.cli import main
from meshlm.config import ModelConfig
from meshlm.data.corpus import default_documents
from meshlm.data.prepare import prepare
from meshlm.data.tokenizer import DEFAULT_PATH, DEFAULT_VOCAB, load_tokenizer
from meshlm.errors import DataError
from meshlm.folders import integrity
from meshlm.folders.locate import locate
from meshlm.interop.convert import convert
from meshlm.loading import open_model
from meshlm.train.trainer import train

WIDE_VOCAB = DEFAULT_VOCAB + 128  # the wide tokenizer's ids, and the Llama model's vocabulary


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A Llama folder whose own tokenizer.json has 8,320 ids (the default BPE plus 128 added tokens,
    common words among them, so text tokenises differently), and data prepared with that
    tokenizer."""
    from transformers import LlamaForCausalLM

    from meshlm.backbones import BACKBONES
    from meshlm.interop.families import hf_config

    root = tmp_path_factory.mktemp("wide")
    tok = Tokenizer.from_file(str(DEFAULT_PATH))
    words = [" the", " and", " of", " to", " in", " was", " that", " his", " he", " it"]
    tok.add_tokens(words + [f"<extra_{i}>" for i in range(WIDE_VOCAB - DEFAULT_VOCAB - len(words))])
    assert tok.get_vocab_size() == WIDE_VOCAB
    cfg = ModelConfig(spec="4", d_model=64, n_heads=4, n_kv_heads=2, vocab_size=WIDE_VOCAB,
                      context_length=64,
                      mlp_hidden=96, backbone="llama", scheme="vanilla", scale_embeddings=False)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_config(cfg, BACKBONES["llama"])).eval()
    folder = root / "llama-wide"
    hf.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    texts = root / "texts"
    texts.mkdir()
    for i, doc in enumerate(itertools.islice(default_documents(), 12)):
        (texts / f"doc{i:02d}.txt").write_text(doc["text"][:20_000])
    data = root / "prepared"
    prepare(sorted(texts.glob("*.txt")), data, str(folder / "tokenizer.json"), val_fraction=0.2,
            progress=False)
    return folder, hf, data


def logits(model, x):
    with torch.no_grad():
        return model(x).logits


def test_a_run_initialised_from_a_hf_folder_is_evaluated_and_probed_with_its_tokenizer(
    wide, tmp_path, capsys):
    folder, _, data = wide
    own = load_tokenizer(folder / "tokenizer.json")
    cfg = tiny_train(data, tmp_path, model={"preset": "mesh-small"}, init_from=str(folder), steps=2,
                     save_every=0)
    run = train(cfg).run_dir
    assert ((run / "latest").is_file()
            and json.loads((integrity.resolve(run) / "config.json").read_text())[
        # the config says "default"; the carried file is what counts
        "train"]["tokenizer"] == "default")
    opened = open_model(run)
    assert (opened.tokenizer.hash, opened.tokenizer.vocab_size) == (own.hash, WIDE_VOCAB)
    assert main(["eval", str(run), "--tasks", "none", "--loops", "none", "--limit", "4"]) == 0
    result = json.loads((run / "eval.json").read_text())
    assert result["perplexity"]["data"] == str(data)  # the data rule: the run's own training data
    assert main(["probe", str(run), "--samples", "2", "--tokens", "16"]) == 0
    assert (run / "probe" / "probe.json").is_file()
    capsys.readouterr()
    # the default tokenizer is not the run's: refused before anything runs
    assert (main(["eval", str(run), "--tasks", "none", "--loops", "none", "--limit", "4",
                  "--tokenizer", "default"]) == 2)
    assert "does not encode like" in capsys.readouterr().err
    # forcing it is still caught: the run's data were not tokenised with it
    assert (main(["eval", str(run), "--tasks", "none", "--loops", "none", "--limit", "4",
                  "--tokenizer", "default",
                  "--force-tokenizer"]) == 2)
    assert "was tokenised with" in capsys.readouterr().err


def test_every_format_opens_to_the_same_model_and_tokenizer(wide, tmp_path):
    folder, hf, _ = wide
    x = torch.randint(0, WIDE_VOCAB, (2, 9))
    reference = logits(hf, x)
    own = load_tokenizer(folder / "tokenizer.json")
    text = "It was the best of times, and it was the worst of times."
    converted = convert(folder, tmp_path / "meshlm")
    as_hf = convert(converted, tmp_path / "hf", to="hf")
    for path, kind in [(folder, "llama"), (converted, "meshlm"), (as_hf, "hf")]:
        opened = open_model(path)
        assert opened.format == kind and opened.run_dir == path, path
        assert (opened.tokenizer.encode(text) == own.encode(text)
                and opened.tokenizer.vocab_size == WIDE_VOCAB), path
        assert (logits(opened.model, x) - reference).abs().max() <= 1e-5, path
    # a meshlm checkpoint carries the file as is
    assert open_model(converted).tokenizer.hash == own.hash
    # carried
    assert json.loads((converted / "config.json").read_text())["tokenizer"] == "tokenizer.json"


def test_retrofit_carries_the_source_tokenizer(wide, tmp_path):
    folder, _, _ = wide
    out = tmp_path / "mesh"
    assert main(["retrofit", str(folder), str(out), "--spec", "1+1R2+1"]) == 0
    opened = open_model(out)
    assert opened.model.config.scheme == "mesh" and opened.tokenizer.vocab_size == WIDE_VOCAB
    integrity.verify(out)  # written by the one checkpoint writer: every file hashed in config.json


def test_a_folder_naming_no_tokenizer(wide, tmp_path):
    """Rule 4: the default is never guessed for a vocabulary it did not make; an explicit choice
    wins."""
    folder, _, _ = wide
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare, ignore=shutil.ignore_patterns("tokenizer.json"))
    opened = open_model(bare)
    assert opened.tokenizer_source is None and opened.tokenizer_file is None
    with pytest.raises(DataError,
                       match="names no tokenizer.*8,320-token vocabulary.*pass --tokenizer"):
        _ = opened.tokenizer
    explicit = open_model(bare, tokenizer=str(folder / "tokenizer.json"))
    assert explicit.tokenizer.vocab_size == WIDE_VOCAB
    # conversion needs no tokenizer and invents none
    converted = convert(bare, tmp_path / "converted")
    assert (not (converted / "tokenizer.json").exists()
            and locate(converted).tokenizer_source() is None)


def test_results_go_to_the_run_of_a_step_and_to_any_other_folder_itself(tmp_path):
    from conftest import build, tiny

    model = build(tiny(vocab_size=DEFAULT_VOCAB))
    step = checkpoint.save_checkpoint(tmp_path / "run", 3, model.state_dict(), {},
                                      {"model": model.config.to_dict()})
    assert locate(tmp_path / "run").path == step and locate(step).run_dir == tmp_path / "run"
    alone = checkpoint.save_model(model, tmp_path / "alone")
    assert locate(alone).run_dir == alone
    assert open_model(alone).tokenizer.name == "default"  # names none, 8,192 ids: rule 4


class Gadget:
    """Stands for any object whose unpickling could run code."""

    def __reduce__(self):
        return (print, ("unpickled: code ran",))


@pytest.mark.parametrize("content, message", [
    ("gadget", "holds pickled Python objects beyond plain tensors, which meshlm never unpickles"),
    ("truncated", "is truncated or corrupt"),
    ("random bytes", r"is not a PyTorch file meshlm can read \(Unsupported operand"),
])
def test_pickle_weights_that_do_not_load_get_one_line_that_never_advises_unsafe_loading(
    wide, tmp_path, content,
                                                                                        message):
    import shutil

    from meshlm.errors import CheckpointError

    folder = tmp_path / "llama"
    shutil.copytree(wide[0], folder)
    (folder / "model.safetensors").unlink()
    if content == "gadget":
        torch.save({"model.embed_tokens.weight": torch.zeros(2), "x": Gadget()},
                   folder / "pytorch_model.bin")
    elif content == "random bytes":
        (folder / "pytorch_model.bin").write_bytes(bytes(range(185, 256)) * 64)
    else:
        torch.save({"model.embed_tokens.weight": torch.zeros(1000)}, folder / "pytorch_model.bin")
        data = (folder / "pytorch_model.bin").read_bytes()
        (folder / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=message) as err:
        open_model(folder)
    assert "weights_only" not in str(err.value) and "\n" not in str(err.value)


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of the functions `count(module, name)` wraps, by name."""
    counted = collections.Counter()

    def count(owner, name):
        original = getattr(owner, name)

        def counting(*args, **kwargs):
            counted[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)

    count.counted = counted
    return count


def test_a_folder_is_recognised_read_built_and_checked_once(wide, tmp_path, calls):
    """Through open_model a Hugging Face family folder is located once, its config translated once,
    its weights read once, its model built once and the weights checked once; a meshlm run
    likewise."""
    from meshlm import loading
    from meshlm.folders import formats, hub
    from meshlm.folders import locate as locating
    from meshlm.model import MeshLM

    for owner, name in [(hub, "resolve"), (locating, "_recognise"), (formats, "family_config"),
                        (formats, "read_weight_files"), (loading, "weight_mismatch"),
                        (MeshLM, "__init__"), (integrity, "load_checkpoint")]:
        calls(owner, name)
    open_model(wide[0])
    assert dict(calls.counted) == {"resolve": 1, "_recognise": 1, "family_config": 1,
                                   "read_weight_files": 1, "weight_mismatch": 1, "__init__": 1}
    run = tmp_path / "run"
    checkpoint.save_checkpoint(run, 1, open_model(wide[0]).model.state_dict(), {},
                               {"model": locate(wide[0]).model_config().to_dict()})
    calls.counted.clear()
    folder = locate(run)
    opened = open_model(folder)  # an already located folder is not recognised again
    assert opened.path == run / "step-000001" and dict(calls.counted) == {
        "resolve": 1, "_recognise": 1, "load_checkpoint": 1, "weight_mismatch": 1, "__init__": 1}


@pytest.fixture
def reads(monkeypatch, calls):
    """Counts, by file name, the files opened (builtins.open, io.open: what pathlib and the hashing
    use), the JSON texts parsed ("json.loads") and the safetensors files loaded ("load_file")."""
    import builtins
    import io
    import os
    from pathlib import Path

    from meshlm.folders import formats

    real_open = io.open

    def counting_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)):
            calls.counted[Path(file).name] += 1
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(io, "open", counting_open)
    for owner, name in [(json, "loads"), (integrity, "load_file"), (formats, "load_file")]:
        calls(owner, name)
    return calls.counted


def test_every_file_of_a_folder_is_read_once_per_open(wide, tmp_path, reads):
    """open_model reads config.json, manifest.json and the weights once each: the config.json bytes
    parsed on recognising are the ones the manifest check hashes (never read again), and the weights
    are hashed once (the integrity check) and loaded once. A run: its `latest` pointer, config.json,
    manifest.json (two JSON texts), the weights; a Hugging Face folder: config.json and the
    weights."""
    hf = open_model(wide[0])
    assert dict(reads) == {"config.json": 1, "loads": 1, "load_file": 1}
    run = tmp_path / "run"
    checkpoint.save_checkpoint(run, 1, hf.model.state_dict(), {},
                               {"model": hf.model.config.to_dict()})
    reads.clear()
    open_model(run)
    assert dict(reads) == {"latest": 1, "config.json": 1, "manifest.json": 1, "loads": 2,
                           "model.safetensors": 1, "load_file": 1}


def test_a_checkpoint_rewritten_between_recognising_and_loading_is_refused(tmp_path):
    """The model is built from the config.json bytes read when the folder was recognised; its
    weights load only if the verified manifest names those bytes. A consistent rewrite in between
    (config.json and manifest.json both new, as another process's atomic save leaves them) is one
    error, not a model built from one config with weights checked against another."""
    from conftest import build, tiny

    from meshlm.errors import CheckpointError

    folder = checkpoint.save_model(build(tiny(spec="1+1R2+1", scheme="base")), tmp_path / "ckpt")
    located = locate(folder)
    assert open_model(located).model.config == located.model_config()  # unchanged: it opens
    meta = integrity.read_meta(folder)
    meta["model"] = {**meta["model"], "spec": "1+1R3+1"}  # same weights, another depth
    checkpoint.seal(folder, meta, [integrity.WEIGHTS])
    integrity.verify(folder)  # a valid checkpoint on its own ...
    with pytest.raises(CheckpointError, match="changed while it was being opened"):
        open_model(located)  # ... but not the one `located` read
    assert open_model(folder).model.config.spec == "1+1R3+1"  # opened afresh, it is the new one
