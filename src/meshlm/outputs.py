"""Output folders: a command never writes over what it did not create.

    out = outputs.claim(args.out, "quantize", args.overwrite, sources=[args.checkpoint])
    ...                                           # compute, then write the folder
    outputs.mark(out, "quantize")                 # last: the folder is now quantize's own

One rule for every command that writes a folder (quantize, convert, retrofit, prepare, probe,
report --figures, tasks export), checked before any work, each refusal a ConfigError (exit 2) of one
line naming the fix:
    a missing or empty folder                     taken
    an earlier output of the same command         taken with --overwrite, refused without it
    any other non-empty folder (a run, notes)     refused, --overwrite or not: choose another folder
    a source, or a folder holding one             refused, --overwrite or not (convert A A)
A folder inside a source is taken (quantize's default RUN/w8a8): no command reads back what it
writes there. With --overwrite, a checkpoint or exported model (quantize, convert, retrofit)
replaces its folder whole; prepare, probe, report and tasks export replace only the files they
write.
`meshlm finetune` writes a training run folder, which resumes rather than being
replaced: `claim_run` takes an empty folder or a meshlm run's own (train's rules then decide between
a fresh start and --resume) and refuses any other, and a source's folder.

"An earlier output of the same command" is what the marker says: MARKER, a dotfile naming the
command, written after the output is complete. It is outside every manifest: checkpoint verification
(which checks the files manifest.json lists), prepared-data manifests and transformers'
from_pretrained of an exported folder never look at it. Outputs from before markers are recognised
by what those commands always wrote (LEGACY); prepared data is recognised by its manifest only, and
gets no marker.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

from meshlm import atomic
from meshlm.data.shards import FORMAT as DATA_FORMAT
from meshlm.data.shards import MANIFEST as DATA_MANIFEST
from meshlm.data.shards import SHARD_GLOB
from meshlm.errors import ConfigError, storage_error
from meshlm.folders.integrity import CONFIG, list_checkpoints, read_json_or_empty
from meshlm.folders.integrity import FORMAT as CHECKPOINT_FORMAT

MARKER = ".meshlm-output.json"
RUN_FILES = (".owner", "latest", "metrics.jsonl")  # what `meshlm train` leaves in every run folder
ANOTHER_RUN = "another run with train.name=... or train.out_dir=..."


def claim(out: str | Path, command: str, overwrite: bool = False,
          sources: Iterable[str | Path] = (), label: str = "--out") -> Path:
    """`out` if `command` may write there (module docstring), else a ConfigError naming `label`
    (how the user gave the folder: --out, output, --figures) and the fix. Reads only."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{label} {out} is a file; pass a folder path")
    never_a_source(out, sources, label)
    if not _entries(out):
        return out
    if made_by(out) != command:
        raise ConfigError(f"{label} {out} already holds files that meshlm {command} did not write; "
                          "choose a new or empty folder (--overwrite only replaces an earlier "
                          f"meshlm {command} output)")
    if not overwrite:
        raise ConfigError(f"{label} {out} already holds an earlier meshlm {command} output; pass "
                          "--overwrite to replace it, or choose another folder")
    return out


def claim_run(run_dir: str | Path, sources: Iterable[str | Path] = ()) -> Path:
    """A run folder `meshlm finetune` may train in: missing, empty, or a meshlm run's own (RUN_FILES
    or step-* checkpoints); never a source's folder or one holding it. Else a ConfigError."""
    run_dir, another = Path(run_dir).expanduser(), ANOTHER_RUN
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run folder {run_dir} is a file; choose {another}")
    never_a_source(run_dir, sources, "run folder", another)
    is_run = any((run_dir / name).exists() for name in RUN_FILES) or list_checkpoints(run_dir)
    if _entries(run_dir) and not is_run:
        raise ConfigError(f"run folder {run_dir} already holds files that no meshlm training "
                          f"wrote; choose {another}")
    return run_dir


def never_a_source(out: Path, sources: Iterable[str | Path], label: str,
                   another: str = "another folder") -> None:
    """A ConfigError if `out` is one of `sources` (those that exist on disk) or holds one."""
    target = out.resolve()
    for source in sources:
        path = Path(source).expanduser()
        if not path.exists():  # a Hub name, or a path that another check reports
            continue
        if path.resolve() == target or target in path.resolve().parents:
            where = "is" if path.resolve() == target else "holds"
            raise ConfigError(f"{label} {out} {where} the source {source}: writing there would "
                              f"destroy it, --overwrite or not; choose {another}")


def made_by(folder: Path) -> str | None:
    """The command whose output `folder` holds: its marker's, else the LEGACY one it looks like;
    None if none."""
    command = read_json_or_empty(folder / MARKER).get("command")
    if isinstance(command, str):
        return command
    return next((name for name, looks in LEGACY.items() if looks(folder)), None)


def mark(folder: str | Path, command: str) -> Path:
    """Record that `folder` holds `command`'s output (atomically, after the output is complete)."""
    record = {"command": command,
              "note": f"written by meshlm {command}; meshlm {command} --overwrite may replace this "
                      "folder, and nothing else writes over it"}
    return atomic.write_text(Path(folder) / MARKER, json.dumps(record, indent=1) + "\n")


def _entries(folder: Path) -> bool:
    """Whether `folder` exists and holds anything (hidden files count)."""
    try:
        return folder.is_dir() and any(folder.iterdir())
    except OSError as err:
        raise storage_error(err, folder, "reading") from None


def _prepared(folder: Path) -> bool:
    """Prepared data, or what a killed `prepare` left: its staging folder (meshlm.data.shards)."""
    return (read_json_or_empty(folder / DATA_MANIFEST).get("format") == DATA_FORMAT
            or any(folder.glob(SHARD_GLOB)) or any(folder.glob(".prepare-*")))


def _quantized(folder: Path) -> bool:
    config = read_json_or_empty(folder / CONFIG)
    return config.get("format") == CHECKPOINT_FORMAT and config.get("quantization") is not None


# command -> what its outputs held before markers (prepare: always; it writes none)
LEGACY: dict[str, Callable[[Path], bool]] = {
    "prepare": _prepared,
    "quantize": _quantized,
    "probe": lambda folder: (folder / "probe.json").is_file(),
    "tasks export": lambda folder: (folder / "meshlm_suite.yaml").is_file(),  # its SUITE_GROUP
}
