"""`meshlm prepare` (inputs, splits, dtypes, EOS, bad bytes, errors, streaming) and reading batches
back."""
from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from meshlm.cli import main
from meshlm.data import prepare as data_mod
from meshlm.data import readers as sources
from meshlm.data.order import batch_indices
from meshlm.data.prepare import PreparedData, prepare, prepare_default
from meshlm.data.tokenizer import load_tokenizer
from meshlm.errors import ConfigError, DataError, MeshlmError
from meshlm.train.batches import get_batch

DOCS = ["First document.\nIt has two lines.\n", "Second, shorter.", "Third — with “unicode”.\n",
        "Fourth document here.", "Fifth and last."]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("default")


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return path


def run_prepare(inputs, out, tok="default", **kw) -> dict:
    return prepare([str(p) for p in inputs], out, tok, progress=False, **kw)


def stream(out: Path, split: str) -> np.ndarray:
    d = PreparedData(out, split)
    return d.tokens(0, d.num_tokens)


def documents_in(out: Path, tok) -> list[str]:
    """Every prepared document (both splits) decoded, split at EOS."""
    docs = []
    for split in ("train", "val"):
        ids = stream(out, split).tolist()
        assert not ids or ids[-1] == tok.eos_id
        cuts = [i for i, t in enumerate(ids) if t == tok.eos_id]
        starts = [0] + [c + 1 for c in cuts[:-1]]
        docs += [tok.decode(ids[s:c]) for s, c in zip(starts, cuts)]
    return sorted(docs)


# ---------------------------------------------------------------- inputs
def test_text_files_become_documents_separated_by_eos(tmp_path, tok):
    files = [write(tmp_path / f"in/{i}.txt", d) for i, d in enumerate(DOCS)]
    m = run_prepare(files, tmp_path / "out")
    assert m["documents"] == 5 and m["dtype"] == "uint16" and m["replaced_bytes"] == 0
    assert m["tokenizer"]["hash"] == tok.hash and m["tokenizer"]["vocab_size"] == 8192
    assert m["splits"]["train"]["documents"] >= 1 and m["splits"]["val"]["documents"] >= 1
    assert documents_in(tmp_path / "out", tok) == sorted(DOCS)
    train = stream(tmp_path / "out", "train").tolist()
    assert train.count(0) == m["splits"]["train"]["documents"]
    assert train[:len(tok.encode(DOCS[0])) + 1] in [tok.encode(d) + [0] for d in DOCS]


def test_folder_is_read_recursively(tmp_path, tok):
    root = tmp_path / "corpus"
    write(root / "a.txt", DOCS[0])
    write(root / "sub/deeper/b.md", DOCS[1])
    write(root / "sub/c.jsonl",
          json.dumps({"text": DOCS[2]}) + "\n" + json.dumps({"text": DOCS[3]}) + "\n")
    write(root / "skip.py", "print('not text')")
    write(root / ".hidden/d.txt", "hidden")
    write(root / "blank.txt", "  \n\n ")
    m = run_prepare([root], tmp_path / "out")
    assert m["documents"] == 4
    assert documents_in(tmp_path / "out", tok) == sorted(DOCS[:4])


def test_an_input_named_twice_or_also_inside_a_folder_given_is_read_once(tmp_path, tok):
    root = tmp_path / "corpus"
    a, b = write(root / "a.txt", DOCS[0]), write(root / "sub/b.txt", DOCS[1])
    m = run_prepare([a, root, tmp_path / "corpus" / "." / "a.txt", b, root], tmp_path / "out")
    assert m["documents"] == 2 and documents_in(tmp_path / "out", tok) == sorted(DOCS[:2])


def test_jsonl_with_text_field_blank_lines_and_nulls(tmp_path, tok):
    lines = [json.dumps({"body": d, "n": i})
             for i, d in enumerate(DOCS)] + ["", json.dumps({"body": None})]
    path = write(tmp_path / "data.jsonl", "\n".join(lines) + "\n")
    m = run_prepare([path], tmp_path / "out", text_field="body")
    assert m["documents"] == 5 and documents_in(tmp_path / "out", tok) == sorted(DOCS)


def test_save_to_disk_dataset_and_dataset_dict(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": DOCS, "id": list(range(5))})
    ds.save_to_disk(str(tmp_path / "ds"))
    m = run_prepare([tmp_path / "ds"], tmp_path / "out")
    assert m["documents"] == 5 and documents_in(tmp_path / "out", tok) == sorted(DOCS)
    dd = datasets.DatasetDict({"train": ds.select(range(3)), "test": ds.select(range(3, 5))})
    dd.save_to_disk(str(tmp_path / "dd"))
    m = run_prepare([tmp_path / "dd"], tmp_path / "out2")
    assert m["documents"] == 5 and documents_in(tmp_path / "out2", tok) == sorted(DOCS)
    with pytest.raises(DataError,
                       match=r"no column 'body' \(columns: text, id\); pass --text-field"):
        run_prepare([tmp_path / "ds"], tmp_path / "out3", text_field="body")


def test_large_vocab_uses_uint32(tmp_path):
    vocab = {"<|endoftext|>": 0, "<|padding|>": 1,
             "[UNK]": 2} | {f"w{i}": i for i in range(3, 70_000)}
    big = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    big.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    big.save(str(tmp_path / "big.json"))
    docs = [write(tmp_path / f"{i}.txt", f"w69999 w{i + 3} w65536") for i in range(3)]
    m = run_prepare(docs, tmp_path / "out", str(tmp_path / "big.json"))
    assert m["dtype"] == "uint32" and m["tokenizer"]["vocab_size"] == 70_000
    ids = np.concatenate([stream(tmp_path / "out", s) for s in ("train", "val")])
    assert ids.max() == 69999 and (ids == 65536).sum() == 3 and (ids == 0).sum() == 3


def test_long_text_is_chunked_without_changing_tokens(tmp_path, tok, monkeypatch):
    monkeypatch.setattr(sources, "CHUNK_CHARS", 1000)
    monkeypatch.setattr(sources, "READ_BYTES", 777)  # reads split multi-byte characters too
    rng = random.Random(0)
    words = ["king", "queen", "é", "naïve", "—", "\n", "\n\n", "  ", "word,", "“quoted”"]
    text = " ".join(rng.choice(words) for _ in range(20_000))
    m = run_prepare([write(tmp_path / "long.txt", text)], tmp_path / "out", shard_tokens=999)
    assert m["replaced_bytes"] == 0 and len(m["splits"]["train"]["shards"]) > 1
    assert stream(tmp_path / "out", "train").tolist() == tok.encode(text) + [0]


def test_invalid_utf8_is_replaced_and_counted(tmp_path, tok, capsys):
    write(tmp_path / "in/a.txt", b"caf\xc3\xa9 ok \xff\xfe bad\n")
    write(tmp_path / "in/b.jsonl", b'{"text": "x \xe9 y \\udc80"}\n')
    assert main(["prepare", str(tmp_path / "in"), "-o", str(tmp_path / "out"), "--quiet"]) == 0
    manifest = json.loads((tmp_path / "out/manifest.json").read_text())
    assert manifest["replaced_bytes"] == 4  # \xff \xfe, a bare \xe9, and a lone-surrogate escape
    assert "4 bytes were not valid UTF-8" in capsys.readouterr().err
    assert documents_in(tmp_path / "out",
                        tok) == sorted(["café ok \ufffd\ufffd bad\n", "x \ufffd y \ufffd"])


# ---------------------------------------------------------------- errors
def bad_inputs(tmp_path: Path) -> list[tuple[list, dict, str]]:
    return [
        ([tmp_path / "missing.txt"], {}, "does not exist; check the path"),
        ([write(tmp_path / "empty.txt", "")], {}, "no text found"),
        ([write(tmp_path / "ws/blank.md", " \n\t\n")], {}, "no text found"),
        ([write(tmp_path / "nodocs/x.csv", "a,b").parent], {}, "holds no .txt"),
        ([write(tmp_path / "f.jsonl", '{"body": "x"}\n')], {},
         "line 1 of .* has no field 'text' \\(fields: body\\)"),
        ([write(tmp_path / "g.jsonl", '{"text": 3}\n')], {}, "is a int, not a string"),
        ([write(tmp_path / "h.jsonl", '{"text": "a"}\n{oops\n')], {},
         "line 2 of .* is not valid JSON"),
        ([write(tmp_path / "i.jsonl", '["text"]\n')], {}, "is a JSON list, not an object"),
        ([write(tmp_path / "ok.txt", "fine")], {"val_fraction": 1.5}, "validation fraction 1.5"),
        ([write(tmp_path / "ok2.txt", "fine")], {"tokenizer": "nope"}, "not 'default', 'pythia'"),
    ]


def test_bad_inputs_raise_one_line_data_errors(tmp_path):
    for inputs, kw, message in bad_inputs(tmp_path):
        tok = kw.pop("tokenizer", "default")
        with pytest.raises(MeshlmError, match=message) as err:
            run_prepare(inputs, tmp_path / "out", tok, **kw)
        assert "\n" not in str(err.value)


def test_cli_exit_code_is_nonzero_on_bad_input(tmp_path, capsys):
    assert main(["prepare", str(tmp_path / "missing"), "-o", str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshlm prepare: error:") and "does not exist" in err and "\n" not in err
    write(tmp_path / "in.jsonl", '{"body": "x"}\n')
    assert (main(["prepare", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out"), "--quiet"])
            != 0)
    assert main(["prepare", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out"), "--quiet",
                 "--text-field", "body"]) == 0


def test_existing_output_needs_overwrite(tmp_path):
    src = write(tmp_path / "a.txt", "some text")
    run_prepare([src], tmp_path / "out")
    with pytest.raises(DataError, match="already holds prepared data; pass --overwrite"):
        run_prepare([src], tmp_path / "out")
    run_prepare([src], tmp_path / "out", overwrite=True)
    with pytest.raises(DataError, match="is a file"):
        run_prepare([src], src)


# ---------------------------------------------------------------- streaming
def test_memory_stays_bounded_by_the_batch(tmp_path):
    """~1.5 MB of JSONL prepared in 16k-character batches: Python-side peak allocation (text, id
    lists, arrays; tracked by tracemalloc) stays far below the input, and shards are flushed as they
    fill."""
    rng = random.Random(0)
    words = "the king and queen of the land said unto people thou art".split()
    path = tmp_path / "big.jsonl"
    with path.open("w") as f:
        for _ in range(1500):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(200))}) + "\n")
    tok = load_tokenizer("default")
    tracemalloc.start()
    try:
        m = run_prepare([path], tmp_path / "out", tok, batch_chars=16_000, shard_tokens=20_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < path.stat().st_size / 4, peak
    train = m["splits"]["train"]
    assert len(train["shards"]) == -(-train["tokens"] // 20_000)
    assert all(s["tokens"] == 20_000 for s in train["shards"][:-1])


# ---------------------------------------------------------------- reading
@pytest.fixture
def sharded(tmp_path) -> Path:
    """A prepared folder whose train split spans several small shards."""
    text = " ".join(f"w{i}" for i in range(3000))
    run_prepare([write(tmp_path / "a.txt", text), write(tmp_path / "b.txt", text[::-1])],
                tmp_path / "out",
                shard_tokens=700, val_fraction=0.0)
    return tmp_path / "out"


def test_sequences_cross_shard_boundaries(sharded):
    d = PreparedData(sharded, "train")
    whole = np.concatenate([np.asarray(s) for s in d.shards]).astype(np.int64)
    assert len(d.shards) > 3 and d.num_tokens == len(whole)
    seq_len = 300
    assert d.num_sequences(seq_len) == (len(whole) - 1) // seq_len
    for i in range(d.num_sequences(seq_len)):
        window = d.sequence(i, seq_len)
        assert (window.dtype == np.int64
                and np.array_equal(window, whole[i * seq_len:(i + 1) * seq_len + 1]))
    with pytest.raises(IndexError):
        d.sequence(d.num_sequences(seq_len), seq_len)
    with pytest.raises(ValueError):
        d.shards[0][0] = 5  # read-only memory map


def test_too_short_split_and_damaged_folders(sharded, tmp_path):
    d = PreparedData(sharded, "train")
    with pytest.raises(DataError,
                       match=f"sequence length {d.num_tokens} exceeds the {d.num_tokens} tokens of "
                             "the training split; lower seq_len or add data"):
        d.num_sequences(d.num_tokens)
    val = PreparedData(sharded, "val")  # val_fraction 0: empty
    with pytest.raises(DataError,
                       match="the validation split of .* is empty; prepare the data again with "
                             "--val-fraction 0.02"):
        get_batch(val, 0, 2, 8, seed=0)
    with pytest.raises(DataError, match="manifest.json missing"):
        PreparedData(tmp_path / "nowhere")
    first = sharded / "train-00000.bin"
    first.write_bytes(first.read_bytes()[:-2])
    with pytest.raises(DataError, match="train-00000.bin is missing or not 1400 bytes long"):
        PreparedData(sharded, "train")


def test_batch_indices_are_deterministic_epoch_permutations():
    n, b = 10, 5
    assert batch_indices(3, b, 7, n) == batch_indices(3, b, 7, n)
    assert batch_indices(0, b, 7, n) != batch_indices(0, b, 8, n)
    for epoch in range(3):  # steps 2e, 2e+1 cover epoch e exactly once
        assert sorted(batch_indices(2 * epoch, b, 7, n)
                      + batch_indices(2 * epoch + 1, b, 7, n)) == list(range(n))
    straddle = batch_indices(1, 7, 0, n)  # positions 7..13: end of epoch 0, start of epoch 1
    assert (straddle[:3] == batch_indices(0, 10, 0, n)[7:]
            and straddle[3:] == batch_indices(1, 10, 0, n)[:4])
    assert len(batch_indices(0, 25, 0, n)) == 25  # batch larger than the data: several epochs


def test_rank_slices_are_disjoint_and_make_the_global_batch(sharded):
    d = PreparedData(sharded, "train")
    seq_len, gb, world, micro = 16, 12, 3, 2
    (x_all, y_all), = get_batch(d, 5, gb, seq_len, seed=1)
    assert x_all.shape == (gb, seq_len) and x_all.dtype == torch.long
    assert torch.equal(x_all[:, 1:], y_all[:, :-1])
    order = batch_indices(5, gb, 1, d.num_sequences(seq_len))
    expected = torch.stack([torch.from_numpy(d.sequence(i, seq_len)) for i in order])
    assert torch.equal(x_all, expected[:, :-1]) and torch.equal(y_all, expected[:, 1:])
    pieces = [get_batch(d, 5, gb, seq_len, seed=1, rank=r, world=world, micro_batches=micro)
              for r in range(world)]
    assert all(len(p) == micro and p[0][0].shape == (gb // world // micro, seq_len) for p in pieces)
    assert torch.equal(torch.cat([x for p in pieces for x, _ in p]), x_all)
    assert torch.equal(torch.cat([y for p in pieces for _, y in p]), y_all)
    rows = [tuple(r.tolist()) for p in pieces for x, _ in p for r in x]
    per_rank = [set(rows[i * 4:(i + 1) * 4]) for i in range(world)]
    assert not (per_rank[0] & per_rank[1] or per_rank[1] & per_rank[2] or per_rank[0] & per_rank[2])
    with pytest.raises(ConfigError, match="must split evenly"):
        get_batch(d, 0, 10, seq_len, seed=0, world=3)
    with pytest.raises(ConfigError):
        get_batch(d, 0, 12, seq_len, seed=0, rank=3, world=3)


# ---------------------------------------------------------------- default corpus
class TinyCorpus:
    description = "tiny test corpus"

    def documents(self, stats):
        for i, text in enumerate(DOCS):
            yield f"tiny/{i}", iter([text])


def test_prepare_default_caches_by_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setattr(data_mod, "EmbeddedCorpus", TinyCorpus)
    first = prepare_default(tmp_path)
    assert first.parent == tmp_path / "prepared" and first.name.endswith(load_tokenizer().hash)
    assert PreparedData(first, "train").num_tokens > 0 and PreparedData(first, "val").num_tokens > 0
    monkeypatch.setattr(data_mod, "prepare", lambda *a, **k: pytest.fail("prepared twice"))
    assert prepare_default(tmp_path) == first
    # no temp folders left
    assert [p.name for p in (tmp_path / "prepared").iterdir()] == [first.name]


@pytest.mark.slow
def test_prepare_default_on_the_embedded_corpus(tmp_path):
    from meshlm.data.corpus import split_documents

    out = prepare_default(tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["splits"]["val"]["documents"] == len(list(split_documents("val")))
    assert PreparedData(out, "train").num_tokens > 3_000_000


def test_safe_chunks_cover_the_text_within_the_limit():
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice("ab \n\n  x") for _ in range(rng.randint(0, 300)))
        pieces = [text[i:i + 37] for i in range(0, len(text), 37)]
        limit = rng.randint(1, 30)
        chunks = list(sources.safe_chunks(pieces, limit))
        assert "".join(chunks) == text and all(0 < len(c) <= limit for c in chunks)


def test_shards_record_their_checksum_and_largest_id(tmp_path):
    import hashlib

    import numpy as np

    from meshlm.data.shards import ShardWriter

    writer = ShardWriter(tmp_path, "train", np.dtype(np.uint16), shard_tokens=5)
    writer.write([3, 9, 4])
    writer.write([70, 1, 2, 8])  # crosses into a second shard
    entry = writer.close()
    assert ([s["tokens"] for s in entry["shards"]] == [5, 2]
            and [s["max_id"] for s in entry["shards"]] == [70, 8])
    for shard in entry["shards"]:
        assert (shard["sha256"] == hashlib.sha256((tmp_path
                                                   / shard["file"]).read_bytes()).hexdigest())


def test_progress_off_a_terminal_is_plain_lines_without_carriage_returns():
    import io

    from meshlm.data.prepare import progress_bar

    log = io.StringIO()  # not a terminal, as a log file
    with progress_bar(1000, True, stream=log) as bar:
        for _ in range(4):
            bar.update(250)
    text = log.getvalue()
    assert ("\r" not in text
            and text.splitlines()[-1] == "tokenizing: 100% (1,000 of 1,000 characters)")
    assert len(text.splitlines()) == 10
    quiet = io.StringIO()
    with progress_bar(1000, False, stream=quiet) as bar:
        bar.update(1000)
    assert quiet.getvalue() == ""
