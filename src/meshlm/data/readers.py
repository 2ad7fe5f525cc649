"""Reading documents to tokenise: text files, folders, JSONL, `datasets` save_to_disk folders, the
embedded corpus.

Every corpus yields `(doc_id, chunks)` pairs in a fixed order: `doc_id` is stable across machines (a
path relative to the input, plus a line or row number) because the train/validation split hashes it,
and `chunks` iterates the document's text in pieces of at most CHUNK_CHARS characters, so a multi-GB
file never sits in memory whole. Pieces are cut only where the GPT-2 pre-tokenizer (used by
byte-level BPE, Pythia's included) starts a new piece anyway, so the tokens equal those of the whole
text; only a text with no space or newline in CHUNK_CHARS characters gets a hard cut.

Documents that are empty or only whitespace are skipped. Bytes that are not valid UTF-8 are decoded
with "surrogateescape" and then each becomes one U+FFFD; `ReadStats.replaced_bytes` counts them
(lone surrogates from JSON escapes such as "\\udc80" are replaced and counted the same way).
Replacing rather than failing keeps one bad byte from stopping a long run; the count is printed and
stored in the manifest.
"""
from __future__ import annotations

import bz2
import codecs
import gzip
import json
import lzma
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from meshlm.data.corpus import default_documents
from meshlm.errors import DataError

CHUNK_CHARS = 1 << 20  # characters per chunk handed to the tokenizer
READ_BYTES = 1 << 20  # bytes per read from a text file
TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".text")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
COMPRESSED = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open}
SAFE_CUT = re.compile(r"(?<=\S)[ \n](?=\S)")  # a lone space/newline between non-spaces
# never valid text: escaped bad bytes or stray JSON escapes
SURROGATE = re.compile("[\ud800-\udfff]")

Documents = Iterator[tuple[str, Iterator[str]]]


BINARY_SAMPLE = 1 << 16  # bytes of each input file looked at to tell text from binary
MAX_INVALID_SHARE = 0.3  # more bytes than this that are not UTF-8 (in the sample): binary, not text
# (random bytes: ~50%; Latin-1 text with accents: a few %)


@dataclass
class ReadStats:
    replaced_bytes: int = 0
    binary: list[str] = field(default_factory=list)  # "path (why)" of inputs skipped as binary

    def scrub(self, text: str) -> str:
        """Lone surrogates (invalid bytes after surrogateescape) -> U+FFFD, counted."""
        text, n = SURROGATE.subn("\ufffd", text)
        self.replaced_bytes += n
        return text


# ---------------------------------------------------------------- text pieces
def safe_chunks(pieces: Iterable[str], max_chars: int | None = None) -> Iterator[str]:
    """Re-cut a stream of strings into chunks of at most max_chars (default CHUNK_CHARS) at safe
    cuts."""
    max_chars = max_chars or CHUNK_CHARS
    buf = ""
    for piece in pieces:
        buf += piece
        start = 0  # walk an index instead of re-slicing buf: linear even for one huge string
        while len(buf) - start > max_chars:  # ">": the character after a cut must be known
            cut = last_safe_cut(buf, start, start + max_chars) or start + max_chars
            yield buf[start:cut]
            start = cut
        buf = buf[start:]
    if buf:
        yield buf


def last_safe_cut(text: str, start: int, end: int) -> int | None:
    """The last position p in (start, end) before a lone space or newline (text[p - 1] and text[p +
    1] not whitespace), or None. The GPT-2 pre-tokenizer starts a new piece at every such p, so
    encoding the two sides separately gives the same tokens as encoding them together. Looks at the
    window's tail first."""
    for lookback in (4096, end - start):
        lo = max(start + 1, end - lookback)
        # endpos end + 1: the lookahead may read text[end]; a match then starts before end
        cuts = [m.start() for m in SAFE_CUT.finditer(text, lo, min(end + 1, len(text)))]
        if cuts or lo == start + 1:
            return cuts[-1] if cuts else None
    return None


def non_blank(chunks: Iterator[str]) -> Iterator[str] | None:
    """The chunks from the first one with non-whitespace text on (leading blank chunks dropped);
    None if the document is blank. Peeking keeps streaming: only whitespace is ever skipped."""
    for chunk in chunks:
        if chunk and not chunk.isspace():
            return _prepend(chunk, chunks)
    return None


def _prepend(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest


def string_chunks(text: str, stats: ReadStats) -> Iterator[str] | None:
    """Chunks of a document held as one string (a JSONL record, a dataset row); None if blank."""
    return non_blank(safe_chunks([stats.scrub(text)]))


def open_binary(path: Path):
    """A binary file object; .gz/.xz/.bz2 are decompressed on the fly."""
    return COMPRESSED.get(path.suffix.lower(), open)(path, "rb")


def base_suffix(path: Path) -> str:
    """".jsonl" for data.jsonl.gz: the suffix that says what the (decompressed) file holds."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSED:
        suffixes.pop()
    return suffixes[-1] if suffixes else ""


def binary_reason(path: Path) -> str | None:
    """Why a file looks binary rather than text: NUL bytes, or a high share of bytes that are not
    UTF-8 in its first BINARY_SAMPLE (decompressed) bytes; None for text."""
    try:
        with open_binary(path) as f:
            head = f.read(BINARY_SAMPLE)
    except (OSError, EOFError, lzma.LZMAError) as err:
        raise DataError(f"{path} cannot be read ({err}); check that it is a complete {path.suffix} "
                        "file") from None
    if b"\x00" in head:
        return "it holds NUL bytes"
    # a cut char waits
    decoded = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape").decode(head)
    invalid = len(SURROGATE.findall(decoded))
    if head and invalid / len(head) > MAX_INVALID_SHARE:
        return f"{invalid / len(head):.0%} of its first {len(head):,} bytes are not UTF-8"
    return None


# ---------------------------------------------------------------- file kinds
def text_file_pieces(path: Path, stats: ReadStats) -> Iterator[str]:
    """Decoded text of a file, READ_BYTES at a time (the incremental decoder holds split
    characters)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    with open_binary(path) as f:
        while block := f.read(READ_BYTES):
            yield stats.scrub(decoder.decode(block))
        yield stats.scrub(decoder.decode(b"", final=True))


def text_file_documents(path: Path, doc_id: str, stats: ReadStats) -> Documents:
    """A text file is one document (BOM dropped)."""
    pieces = text_file_pieces(path, stats)
    chunks = non_blank(safe_chunks(p.removeprefix("\ufeff") if i == 0 else p
                                   for i, p in enumerate(pieces)))
    if chunks is not None:
        yield doc_id, chunks


def jsonl_documents(path: Path, doc_id: str, text_field: str, stats: ReadStats) -> Documents:
    """Each non-blank line of a JSONL file is one document: the string under `text_field`."""
    with open_binary(path) as f:
        for lineno, raw in enumerate(f, 1):
            line = stats.scrub(raw.decode("utf-8", errors="surrogateescape"))
            if not line.strip():
                continue
            text = record_text(parse_json(line, path, lineno), text_field,
                               f"line {lineno} of {path}")
            chunks = string_chunks(text, stats)
            if chunks is not None:
                yield f"{doc_id}:{lineno}", chunks


def parse_json(line: str, path: Path, lineno: int) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"line {lineno} "
                        f"of {path} is not valid JSON ({err.msg}); fix or remove it") from None


def record_text(record: object, text_field: str, where: str) -> str:
    """The text of one JSON record; DataError naming the available fields when `text_field` is
    missing."""
    if not isinstance(record, dict):
        raise DataError(f"{where} is a JSON {type(record).__name__}, not an object; each line "
                        f"needs {{\"{text_field}\": ...}}")
    if text_field not in record:
        raise DataError(f"{where} has no field {text_field!r} (fields: "
                        f"{', '.join(map(str, record)) or 'none'}); pass --text-field")
    return check_text(record[text_field], text_field, where)


def check_text(text: object, text_field: str, where: str) -> str:
    """A record's text value: a string, or None (an empty document); anything else is an error."""
    if text is None:
        return ""
    if not isinstance(text, str):
        raise DataError(f"field {text_field!r} in {where} is a {type(text).__name__}, not a "
                        "string; pass the --text-field that holds the text")
    return text


# ---------------------------------------------------------------- save_to_disk folders
def is_dataset_dir(path: Path) -> bool:
    """A folder written by Dataset.save_to_disk or DatasetDict.save_to_disk."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file())


def dataset_documents(path: Path, doc_id: str, text_field: str, stats: ReadStats) -> Documents:
    """Each row is one document; a DatasetDict is read split by split in sorted order (its own
    train/test division is ignored: meshlm makes its own split by document)."""
    import datasets  # slow import: only when a dataset folder is read

    loaded = datasets.load_from_disk(str(path))
    parts = sorted(loaded.items()) if isinstance(loaded, datasets.DatasetDict) else [("", loaded)]
    for part_name, part in parts:
        if text_field not in part.column_names:
            raise DataError(f"dataset {path} has no column {text_field!r} (columns: "
                            f"{', '.join(part.column_names)}); pass --text-field")
        prefix = f"{doc_id}/{part_name}" if part_name else doc_id
        row = 0
        for batch in part.select_columns([text_field]).iter(batch_size=256):
            for text in batch[text_field]:
                chunks = string_chunks(check_text(text, text_field, f"row {row} of {path}"), stats)
                if chunks is not None:
                    yield f"{prefix}:{row}", chunks
                row += 1


# ---------------------------------------------------------------- corpora
def path_documents(path: Path, doc_id: str, text_field: str, stats: ReadStats) -> Documents:
    """One input file: JSONL by suffix, anything else named explicitly is read as text."""
    if base_suffix(path) in JSONL_SUFFIXES:
        return jsonl_documents(path, doc_id, text_field, stats)
    return text_file_documents(path, doc_id, stats)


def folder_files(root: Path) -> list[Path]:
    """Text and JSONL files under a folder, recursively, sorted; hidden files and folders
    skipped."""
    wanted = TEXT_SUFFIXES + JSONL_SUFFIXES
    return sorted(p for p in root.rglob("*")
                  if p.is_file() and base_suffix(p) in wanted
                  and not any(part.startswith(".") for part in p.relative_to(root).parts))


class FileCorpus:
    """The user's inputs: files, folders (recursive) and save_to_disk folders, read in argument
    order."""

    def __init__(self, inputs: Iterable[str | Path], text_field: str = "text",
                 allow_binary: bool = False):
        self.inputs = [Path(p).expanduser() for p in inputs]
        self.text_field, self.allow_binary = text_field, allow_binary
        if not self.inputs:
            raise DataError("no input given; pass at least one file or folder")
        missing = [str(path) for path in self.inputs if not path.exists()]
        if missing:
            raise DataError(f"input{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                            f"do{'' if len(missing) > 1 else 'es'} not exist; check the path")
        self.description = ", ".join(str(p) for p in self.inputs)

    def _file_documents(self, path: Path, doc_id: str, stats: ReadStats) -> Documents:
        """One file's documents; a binary-looking file is recorded in `stats.binary` and skipped
        (unless allow_binary: then its bad bytes become U+FFFD like any others)."""
        reason = None if self.allow_binary else binary_reason(path)
        if reason is not None:
            stats.binary.append(f"{path} ({reason})")
            return iter(())
        return path_documents(path, doc_id, self.text_field, stats)

    def documents(self, stats: ReadStats) -> Documents:
        """Every input's documents once: a file named twice, or also inside a folder given, is read
        once."""
        read: set[Path] = set()
        for path in self.inputs:
            if path.resolve() in read:
                continue
            read.add(path.resolve())
            if path.is_dir() and is_dataset_dir(path):
                yield from dataset_documents(path, path.name, self.text_field, stats)
            elif path.is_dir():
                files = folder_files(path)
                if not files:
                    raise DataError(f"folder {path} holds no "
                                    f"{'/'.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} files; point at "
                                    "the text files")
                for file in (f for f in files if f.resolve() not in read):
                    read.add(file.resolve())
                    yield from self._file_documents(file, f"{path.name}"
                                                          f"/{file.relative_to(path).as_posix()}",
                                                    stats)
            else:
                yield from self._file_documents(path, path.name, stats)


class EmbeddedCorpus:
    """The default corpus shipped in the package (meshlm.data.corpus); ids are the documents' own
    ids."""

    description = "embedded default corpus (Shakespeare, Milton, World English Bible)"

    def documents(self, stats: ReadStats) -> Documents:
        for doc in default_documents():
            chunks = string_chunks(doc["text"], stats)
            if chunks is not None:
                yield doc["id"], chunks
