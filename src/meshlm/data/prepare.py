"""Tokenised training data: `prepare` writes token shards, `PreparedData` reads them back,
`batch_indices` orders them.

Preparing (meshlm prepare) streams: documents are read in chunks (meshlm.data.readers), encoded a
batch of ~`batch_chars` characters at a time and appended to shard files (meshlm.data.shards), so
memory stays bounded by the batch, whatever the corpus size. It makes two passes over the inputs:
the first only lists document ids, so the train/validation split by document (meshlm.data.split) can
guarantee both sides are non-empty without holding anything; the second tokenises. EOS follows every
document.

Reading is stateless: the global batch of optimizer step s is a pure function of (s, seed, data),
drawn from per-epoch permutations of the non-overlapping windows, so a resumed run replays exactly
the same data, and each rank takes a fixed, disjoint slice of it.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

from meshlm.data.cache_dir import cache_dir as resolve_cache
from meshlm.data.corpus import VAL_FRACTION, corpus_fingerprint
from meshlm.data.examples import example_targets, max_label
from meshlm.data.readers import EmbeddedCorpus, FileCorpus, ReadStats
from meshlm.data.shards import (
    FORMAT,
    MANIFEST,
    SHARD_GLOB,
    ShardWriter,
    max_id,
    open_labels,
    open_loss_mask,
    open_shards,
    read_manifest,
    staged,
    token_dtype,
    write_manifest,
)
from meshlm.data.split import SPLITS, TRAIN, VAL, SplitPlan
from meshlm.data.tokenizer import TextTokenizer, load_tokenizer
from meshlm.errors import ConfigError, DataError

DEFAULT_VAL_FRACTION = 0.02
DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB per uint16 shard
BATCH_CHARS = 1 << 21  # characters encoded per tokenizer call: ~0.5M tokens, a few tens of MB


# ---------------------------------------------------------------- preparing
def prepare(inputs, out_dir: str | os.PathLike, tokenizer: str | TextTokenizer = "default", *,
            text_field: str = "text", val_fraction: float = DEFAULT_VAL_FRACTION,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, overwrite: bool = False,
            progress: bool = True,
            batch_chars: int = BATCH_CHARS, allow_binary: bool = False) -> dict:
    """Tokenise `inputs` (paths, or a corpus object with .description/.documents) into `out_dir`.

    Returns the manifest (also written to out_dir/manifest.json). Raises DataError on missing
    inputs, no text, a missing text field, binary-looking input files (unless allow_binary), or an
    out_dir that already holds prepared data (unless overwrite). The shards are written into a
    staging folder inside out_dir and moved in only once complete (shards.install_prepared): a
    failure (a full disk, Ctrl-C) removes the staging folder and leaves what out_dir held, prepared
    data included, as it was.
    """
    tok = tokenizer if isinstance(tokenizer, TextTokenizer) else load_tokenizer(tokenizer)
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    corpus = (inputs if hasattr(inputs, "documents")
              else FileCorpus(inputs, text_field, allow_binary))
    plan, n_chars = plan_documents(corpus, val_fraction)
    out = ready_output_dir(Path(out_dir), overwrite)
    with staged(out) as staging:
        return write_prepared(corpus, plan, n_chars, staging, tok, val_fraction, shard_tokens,
                              progress,
                              batch_chars)


class _PlainProgress:
    """Off a terminal (a log file, a batch job) a tqdm bar's carriage returns pile up into one line:
    one plain line per tenth of the characters instead."""

    def __init__(self, total: int, stream):
        self.total, self.done, self.tenths, self.stream = max(total, 1), 0, 0, stream

    def update(self, n: int) -> None:
        self.done += n
        while self.tenths < min(10, self.done * 10 // self.total):
            self.tenths += 1
            print(f"tokenizing: {10 * self.tenths}% ({self.done:,} of {self.total:,} characters)",
                  file=self.stream, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def progress_bar(n_chars: int, progress: bool, stream=None):
    """tqdm on a terminal, plain lines elsewhere, nothing without `progress`."""
    stream = stream or sys.stderr
    if progress and not stream.isatty():
        return _PlainProgress(n_chars, stream)
    return tqdm(total=n_chars, unit="char", unit_scale=True, desc="tokenizing",
                disable=not progress, file=stream)


def write_prepared(corpus, plan: SplitPlan, n_chars: int, out: Path, tok: TextTokenizer,
                   val_fraction: float,
                   shard_tokens: int, progress: bool, batch_chars: int) -> dict:
    """Second pass: tokenise every document into its split's shards, then write the manifest."""
    dtype = token_dtype(tok.vocab_size)
    writers = {split: ShardWriter(out, split, dtype, shard_tokens) for split in SPLITS}
    stats = ReadStats()
    with progress_bar(n_chars, progress) as bar:
        batch: list[tuple[ShardWriter, str, bool]] = []  # (writer, text, last chunk of its
        # document)
        batch_len = 0
        for doc_id, chunks in corpus.documents(stats):
            writer = writers[plan.split_of(doc_id)]
            writer.documents += 1
            for chunk, is_last in _with_last(chunks):
                batch.append((writer, chunk, is_last))
                batch_len += len(chunk)
                if batch_len >= batch_chars:
                    bar.update(encode_and_write(tok, batch))
                    batch, batch_len = [], 0
        bar.update(encode_and_write(tok, batch))
    manifest = {
        "format": FORMAT,
        "tokenizer": {"name": tok.name, "hash": tok.hash, "vocab_size": tok.vocab_size,
                      "eos_id": tok.eos_id, "pad_id": tok.pad_id},
        "dtype": dtype.name,
        "source": corpus.description,
        "val_fraction": val_fraction,
        "documents": plan.n_docs,
        "replaced_bytes": stats.replaced_bytes,
        "splits": {split: writer.close() for split, writer in writers.items()},
    }
    write_manifest(out, manifest)
    return manifest


def plan_documents(corpus, val_fraction: float) -> tuple[SplitPlan, int]:
    """First pass: every document id into the split plan, and the total characters (for the progress
    bar)."""
    plan, n_chars, stats = SplitPlan(val_fraction), 0, ReadStats()
    for doc_id, chunks in corpus.documents(stats):
        plan.add(doc_id)
        n_chars += sum(len(chunk) for chunk in chunks)
    if stats.binary:
        listed = "; ".join(stats.binary[:3]) + (f"; and {len(stats.binary) - 3} more"
                                                if len(stats.binary) > 3 else "")
        raise DataError(f"{len(stats.binary)} input file(s) look binary, not text: {listed}. Text "
                        "in another encoding: convert it to UTF-8 (e.g. iconv -f LATIN1 -t "
                        "UTF-8); to read the files anyway (bad bytes become U+FFFD), pass "
                        "--allow-binary")
    if plan.n_docs == 0:
        raise DataError(f"no text found in {corpus.description}; give files or records with "
                        "non-empty text")
    return plan, n_chars


def ready_output_dir(out: Path, overwrite: bool) -> Path:
    if out.exists() and not out.is_dir():
        raise DataError(f"output {out} is a file; pass a folder path")
    out.mkdir(parents=True, exist_ok=True)
    holds_data = (out / MANIFEST).exists() or any(out.glob(SHARD_GLOB))
    if holds_data and not overwrite:
        raise DataError(f"output folder {out} already holds prepared data; pass --overwrite or "
                        "another folder")
    return out


def _with_last(items):
    """(item, is_last) pairs, peeking one ahead."""
    it = iter(items)
    prev = next(it, None)
    for item in it:
        yield prev, False
        prev = item
    if prev is not None:
        yield prev, True


def encode_and_write(tok: TextTokenizer, batch: list[tuple[ShardWriter, str, bool]]) -> int:
    """Encode the batch in one parallel call and append each chunk's ids (+ EOS after a document's
    last chunk) to its split; returns the characters consumed."""
    if not batch:
        return 0
    for (writer, _, is_last), ids in zip(batch, tok.encode_batch([text for _, text, _ in batch])):
        writer.write(ids + [tok.eos_id] if is_last else ids)
    return sum(len(text) for _, text, _ in batch)


def prepare_default(cache_dir: str | os.PathLike | None = None, tokenizer: str = "default",
                    progress: bool = False) -> Path:
    """The embedded corpus, prepared once per (corpus, tokenizer) into the cache; returns its
    folder.

    Safe when several processes (ranks) call it at once: each prepares into a private temporary
    folder and renames it into place; the first rename wins and the others discard their copy.
    """
    tok = load_tokenizer(tokenizer, cache_dir)
    parent = resolve_cache(cache_dir) / "prepared"
    target = parent / f"default-v2-{corpus_fingerprint()}-{tok.hash}"  # v2: shards carry checksums
    if (target / MANIFEST).is_file():
        return target
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache entry it becomes need not be
    try:
        prepare(EmbeddedCorpus(), tmp, tok, val_fraction=VAL_FRACTION, progress=progress)
        os.rename(tmp, target)
    except OSError:
        if not (target / MANIFEST).is_file():  # not a lost race: a real failure
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


TINY_VAL_TOKENS = 4096  # below this, a validation loss is noisy and long sequences do not fit


def split_warnings(manifest: dict) -> list[str]:
    """Warnings about an empty or tiny validation split, each with advice that changes the
    outcome."""
    val, total = manifest["splits"][VAL]["tokens"], sum(s["tokens"]
                                                        for s in manifest["splits"].values())
    documents, fraction = manifest["documents"], manifest["val_fraction"]
    if val >= TINY_VAL_TOKENS:
        return []
    if documents == 1:
        return [f"the validation split is {'empty' if not val else f'only {val:,} tokens'}: the "
                "split is by document and the input is one document; give several files, or a "
                "JSONL file with one document per line"]
    if fraction == 0:
        return ["the validation split is empty (--val-fraction 0); `meshlm train` needs one: pass "
                "--val-fraction 0.02"]
    if total < 2 * TINY_VAL_TOKENS:
        return [f"the validation split holds only {val:,} tokens because the corpus holds only "
                f"{total:,}; validation losses will be noisy and train.seq_len must stay below "
                f"{val:,}: add text"]
    better = min(0.5, max(2 * fraction, 1.5 * TINY_VAL_TOKENS / total))
    return [f"the validation split holds only {val:,} tokens "
            f"({manifest['splits'][VAL]['documents']} of {documents} documents); validation losses "
            f"will be noisy and train.seq_len must stay below {val:,}: pass --val-fraction "
            f"{better:.2g} (documents are held out whole, so the share is approximate) or add "
            "documents"]


# ---------------------------------------------------------------- reading
class PreparedData:
    """One split of a prepared folder as a single token stream over read-only memory-mapped shards.

    Sequence i is the window of seq_len + 1 tokens starting at token i * seq_len (inputs and shifted
    targets share their boundary token); windows may span shards and documents (EOS marks the
    joins).
    """

    def __init__(self, data_dir: str | os.PathLike, split: str = TRAIN):
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
        self.dir, self.split = Path(data_dir), split
        self.manifest = read_manifest(data_dir)
        self.shards = open_shards(data_dir, self.manifest, split)
        # task data: 1 = answer token; else None offsets[k] = stream position of shard k's first
        # token; offsets[-1] = total
        self.masks = open_loss_mask(data_dir, self.manifest, split)
        # labelled task data: the target of each position, aligned with the tokens; else None
        self.labels = open_labels(data_dir, self.manifest, split)
        self.offsets = np.cumsum([0] + [len(s) for s in self.shards])
        self.num_tokens = int(self.offsets[-1])
        self.id_limit: int | None = None  # the model's vocabulary, once check_ids has seen it
        # labelled data: what positions without a label learn (train.unlabelled; example_targets)
        self.unlabelled = "ignore"
        for side, what in ((self.masks, "answer mask"), (self.labels, "label stream")):
            if side is not None and [len(m) for m in side] != [len(s) for s in self.shards]:
                raise DataError(f"{data_dir}: the {what} of the {split} split does not line up "
                                "with its tokens; run `meshlm prepare` again")

    @property
    def vocab_size(self) -> int:
        return self.manifest["tokenizer"]["vocab_size"]

    def check_ids(self, model_vocab_size: int) -> None:
        """DataError unless every token id fits the model's embedding (an id beyond it would stop
        training with an IndexError whenever its window came up, possibly hours in). The check
        trusts the manifest's max_id; every window read afterwards is checked against the vocabulary
        too, so a stale manifest stops at the first window that breaks it, in one line."""
        self.id_limit = model_vocab_size
        largest = max_id(self.manifest, self.split, self.shards)
        label = max_label(self.labels, np.dtype(self.manifest["dtype"]))
        if label >= model_vocab_size:
            raise DataError(f"{self.dir} ({self.split} split) holds label id {label:,}, but the "
                            f"model's vocabulary has {model_vocab_size:,} ids; prepare the data "
                            "again with `meshlm prepare task:NAME` or set model.vocab_size to at "
                            f"least {label + 1:,}")
        if largest >= model_vocab_size:
            raise DataError(f"{self.dir} ({self.split} split) holds token id {largest:,}, but the "
                            f"model's vocabulary has {model_vocab_size:,} ids; prepare the data "
                            "with the model's tokenizer or set model.vocab_size to at least "
                            f"{largest + 1:,}")

    def num_sequences(self, seq_len: int) -> int:
        """How many windows fit; DataError if not even one does."""
        if seq_len < 1:
            raise ConfigError(f"sequence length {seq_len} is below 1")
        name = "validation" if self.split == VAL else "training"
        if self.num_tokens < 2:  # no window at any length: lowering seq_len cannot help
            fix = ("prepare the data again with --val-fraction 0.02" if self.split == VAL
                   else "add documents")
            raise DataError(f"the {name} split of {self.dir} is empty; {fix}")
        if self.num_tokens < seq_len + 1:
            raise DataError(f"sequence length {seq_len} exceeds the {self.num_tokens} tokens of "
                            f"the {name} split; lower seq_len or add data")
        return (self.num_tokens - 1) // seq_len

    def tokens(self, start: int, stop: int, shards: list[np.memmap] | None = None) -> np.ndarray:
        """Stream positions [start, stop) as int64, gathered across shard boundaries (of `shards`,
        default the tokens'; the answer mask's are aligned with them)."""
        shards = self.shards if shards is None else shards
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        parts, pos, k = [], start, first
        while pos < stop:
            local = pos - int(self.offsets[k])
            take = min(stop - pos, len(shards[k]) - local)
            parts.append(shards[k][local:local + take])
            pos, k = pos + take, k + 1
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def inputs_targets(self, indices: list[int], seq_len: int, ignore_index: int = -100
                       ) -> tuple[np.ndarray, np.ndarray]:
        """Windows `indices` as int64 (len(indices), seq_len) inputs and next-token targets, the
        targets `ignore_index` where task data's answer mask says the loss does not look (prompts,
        padding); plain text keeps every target. Labelled task data replace the next tokens by the
        label stream (the target of position i is its label; where it has none `ignore_index`, or
        its next token with unlabelled="next"), so a label is never an input. Each window is read
        once."""
        windows = np.stack([self.sequence(i, seq_len) for i in indices])  # (n, seq_len + 1)
        if self.id_limit is not None and (largest := int(windows.max())) >= self.id_limit:
            raise DataError(f"{self.dir} ({self.split} split) holds token id {largest:,}, past the "
                            f"model's {self.id_limit:,} ids, though its manifest says at most "
                            f"{max_id(self.manifest, self.split, self.shards):,}: the manifest is "
                            "stale; prepare the data again (meshlm prepare ... --overwrite)")
        targets = example_targets(self, indices, seq_len, windows[:, 1:], ignore_index,
                                  self.unlabelled)
        return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(targets)

    def sequence(self, i: int, seq_len: int) -> np.ndarray:
        """Window i: seq_len + 1 tokens (int64)."""
        n = self.num_sequences(seq_len)
        if not 0 <= i < n:
            raise IndexError(f"sequence {i} out of range [0, {n})")
        return self.tokens(i * seq_len, i * seq_len + seq_len + 1)
