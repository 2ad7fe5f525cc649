"""Which file an evaluation writes: a run's eval.json is never replaced by a narrower evaluation
unannounced.

`meshlm eval RUN --limit 50` after a full `meshlm eval RUN` used to replace the full results, and a
study or a report then read the quick look as the run's numbers. Each eval.json now records its
`scope` (the data, suite, tasks, shots, limit, loop counts and exit rules it was asked for), and:

- no eval.json yet, or one of the same scope (a rerun, or an interrupted one): the new results go
  there;
- the new scope covers the old one (same data and suite, at least its tasks, shots, loops and exits,
  no smaller a limit): eval.json gets the new results, the old ones move beside it to eval-<scope
  hash>.json;
- otherwise (narrower, other data, or an older file that records no scope): the new results go
  beside, to eval-<scope hash>.json, and eval.json stays.

Either way one line says where the results went and why. `--out` writes where it says.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from meshlm.evaluation.records import ResultError, UnreadableResult
from meshlm.evaluation.results import read_eval

PRIMARY = "eval.json"
SET_FIELDS = ("tasks", "shots", "loops", "exits")  # the new scope must hold at least the old one's


def scope_of(data: str | None, suite: str, tasks: str | None, shots: list[int], limit: int | None,
             loops: list[int] | None, exits: list, exit_loops: int | None) -> dict:
    """What an evaluation was asked for, as plain JSON (None = a default: the run's data, the
    default counts)."""
    task_list = (sorted(t.strip() for t in tasks.split(",")) if isinstance(tasks, str)
                 else sorted(tasks or []))
    return {"data": data, "suite": suite, "tasks": task_list,
            "shots": sorted(shots) if task_list else [],
            "limit": limit, "loops": None if loops is None else sorted(loops),
            "exits": sorted(map(str, exits)),
            "exit_loops": exit_loops}


def scope_hash(scope: dict) -> str:
    return hashlib.sha256(json.dumps(scope, sort_keys=True).encode()).hexdigest()[:8]


def covers(new: dict, old: dict) -> bool:
    """Everything `old` measured, `new` measures too (on the same data, at least as many items)."""
    if any(new.get(k) != old.get(k) for k in ("data", "suite", "exit_loops")):
        return False
    for key in SET_FIELDS:
        a, b = new.get(key), old.get(key)
        if (a is None) != (b is None) or (a is not None and not set(b) <= set(a)):
            return False
    return (new.get("limit") is None
            or (old.get("limit") is not None and new["limit"] >= old["limit"]))


def choose(run_dir: Path, scope: dict) -> tuple[Path, str | None]:
    """(where to write, a line saying what happened to the existing results, or None); may move the
    old eval.json aside (when the new scope covers it)."""
    primary = run_dir / PRIMARY
    try:
        old = read_eval(primary)
        if old is None:
            return primary, None  # none yet
        old_scope = old.scope
    except UnreadableResult:
        return primary, None  # nothing worth keeping
    except ResultError:
        old_scope = None  # JSON that holds no eval result: it stays, as one that records no scope
    if old_scope == scope:
        return primary, None
    if old_scope is not None and covers(scope, old_scope):
        aside = run_dir / f"eval-{scope_hash(old_scope)}.json"
        primary.replace(aside)
        return primary, f"eval.json held a narrower evaluation; it is kept as {aside.name}"
    beside = run_dir / f"eval-{scope_hash(scope)}.json"
    why = ("records no scope (an older meshlm)" if old_scope is None
           else "holds an evaluation this one does not cover")
    return beside, f"{primary} {why}, so it stays; these results go to {beside.name}"
