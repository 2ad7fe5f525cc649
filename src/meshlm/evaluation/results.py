"""What `meshlm eval` and `meshlm probe` write: these types are the schema of their JSON files.

    EvalResult   <run>/eval.json (meshlm.evaluation.run): checkpoint, step, model, accounting,
                 complete, perplexity, loops, exit, downstream (a Suite per few-shot setting),
                 reasoning, seconds, dtype, scope
    ProbeResult  <run>/probe/probe.json (meshlm.analysis.probes): checkpoint, step, label, model,
                 dtype, samples, tokens, stages, blocks, every measure as a Spread (mean and std
                 over samples), per_sample, slots

`read_eval` and `read_probe` are the one way to read them; both upgrade what older meshlm versions
wrote (`upgrade_eval` and `upgrade_probe` say what each lacked). `write` replaces a file atomically
(meshlm.atomic). A key that a type does not declare is kept and written back
(meshlm.evaluation.records).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from meshlm import atomic
from meshlm.evaluation.records import Record, ResultError, UnreadableResult, optional
from meshlm.evaluation.tasks import PAPER_TASKS

R = TypeVar("R", bound=Record)


# -- eval.json ------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Perplexity(Record):
    """exp(mean next-token loss) over `sequences` windows of a prepared split (task data: the
    answers only)."""

    loss: float
    ppl: float
    tokens: int  # target tokens scored
    sequences: int
    data: str  # the prepared-data folder
    split: str
    seq_len: int


@dataclass(kw_only=True)
class DepthRow(Record):
    """Validation loss at K' loop steps (meshlm.evaluation.perplexity.loss_vs_loops)."""

    loops: int
    trained: bool  # K' is the trained K
    loss: float
    ppl: float
    tokens: int
    sequences: int


@dataclass(kw_only=True)
class ExitRow(Record):
    """One adaptive-exit rule, at most `max_loops` steps (meshlm.evaluation.perplexity)."""

    exit: str
    max_loops: int
    loss: float
    ppl: float
    tokens: int
    sequences: int
    avg_loops: float  # loop steps per token
    avg_probes: float  # coda + head evaluations per token (kl rules)
    flops_ratio: float  # forward FLOPs per token against fixed depth max_loops


@dataclass(kw_only=True)
class TaskScore(Record):
    """One task of a suite: the paper's metric as `score` (a fraction), lm-eval's standard error.

    The suite's own tasks also carry acc and acc_norm (None where lm-eval has no such metric); any
    other lm-eval task (`external`) carries its output type and every metric lm-eval reported."""

    acc: float | None = None
    acc_norm: float | None = None
    metric: str
    score: float | None
    stderr: float | None = None
    items: int
    perplexity: float | None = optional()  # LAMBADA
    output_type: str | None = optional()
    external: bool = False
    metrics: dict[str, float] | None = optional()

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        for key in ("acc", "acc_norm") if self.external else ("external",):
            out.pop(key, None)
        return out


@dataclass(kw_only=True)
class Suite(Record):
    """One few-shot setting of the downstream suite (meshlm.evaluation.downstream.run_suite)."""

    tasks: dict[str, TaskScore]
    average: float | None  # mean of the paper metrics over the suite's tasks that have one
    covered: int  # how many of the paper's tasks that average covers …
    of: int = PAPER_TASKS  # … of these
    items: int
    shots: int
    limit: int | None = None  # items per task (None: every item)
    seconds: float
    dtype: str = ""  # the precision the scores were computed in

    @property
    def coverage(self) -> str:
        """"8 of the paper's 9 tasks"."""
        return f"{self.covered} of the paper's {self.of} tasks"


@dataclass(kw_only=True)
class LevelScore(Record):
    """Exact-match accuracy over the problems of one difficulty, and its binomial standard error."""

    acc: float
    stderr: float
    n: int


@dataclass(kw_only=True)
class ExitLevelScore(LevelScore):
    avg_loops: float  # loop steps per processed token (prompt and answer)
    answer_loops: float | None  # per position that produced an answer token (None: there was none)


@dataclass(kw_only=True)
class ReasoningDepth(Record):
    loops: int
    acc: float
    stderr: float
    n: int
    levels: dict[str, LevelScore]  # by difficulty ("3": ...)


@dataclass(kw_only=True)
class ReasoningExit(Record):
    exit: str
    max_loops: int
    acc: float
    stderr: float
    n: int
    avg_loops: float
    answer_loops: float | None
    spearman: float | None  # answer loops against difficulty (None: constant loops)
    levels: dict[str, ExitLevelScore]


@dataclass(kw_only=True)
class ReasoningTask(Record):
    train_levels: str | None  # "1-8": the difficulties trained on
    test_levels: str | None
    trained_loops: int
    loops: list[ReasoningDepth]
    exit: list[ReasoningExit] = field(default_factory=list)
    # "problem" (exact match of one answer) or "position" (labelled data: every labelled position
    # scored, by its own difficulty)
    unit: str = optional("problem")
    # labelled data: accuracy on the positions of difficulty <= the trained loop count, by loop
    # count ("4": ..., "8": ..., "16": ...): whether answers hold when run past the trained depth
    stability: dict[str, LevelScore] | None = optional()


@dataclass(kw_only=True)
class Reasoning(Record):
    """The reasoning suite (meshlm.evaluation.reasoning): per task, accuracy by difficulty × loops
    and under exit."""

    tasks: dict[str, ReasoningTask]
    seconds: float
    train_loops: Any = optional()  # the run's train.loops: how its depth was trained ("fixed", …)


@dataclass(kw_only=True)
class EvalResult(Record):
    """A run's eval.json. Written after every stage with complete = False until the last one."""

    checkpoint: str
    step: int | None
    model: dict[str, Any]  # ModelConfig.to_dict()
    accounting: dict[str, Any]  # meshlm.model.accounting.Accounting.to_dict()
    complete: bool = False
    perplexity: Perplexity
    loops: list[DepthRow] = field(default_factory=list)
    exit: list[ExitRow] = field(default_factory=list)
    downstream: dict[str, Suite] = field(default_factory=dict)  # by few-shot count: "0", "5"
    reasoning: Reasoning | None = optional()  # task data only
    seconds: float | None = optional()
    dtype: str | None = optional()
    scope: dict[str, Any] | None = optional()  # what it was asked for (meshlm.evaluation.scope)


def upgrade_eval(raw: dict[str, Any]) -> dict[str, Any]:
    """An eval.json of any meshlm version in today's form (a copy; today's files come back as they
    are)."""
    raw = dict(raw)
    if "complete" not in raw:  # before partial saves: the file was written once, at the end
        raw["complete"] = True
        raw.setdefault("dtype", "fp32")  # before the run policy's autocast, too: all in fp32
    raw.setdefault("exit", [])  # before adaptive exit
    suites = raw.get("downstream")
    if isinstance(suites, dict):
        dtype = raw.get("dtype") or ""
        raw["downstream"] = {shots: _upgrade_suite(s, dtype) for shots, s in suites.items()}
    return raw


def _upgrade_suite(suite: Any, dtype: str) -> Any:
    if not isinstance(suite, dict) or not isinstance(suite.get("tasks"), dict):
        return suite
    tasks = suite["tasks"].values()
    scored = sum(isinstance(t, dict) and t.get("score") is not None for t in tasks)
    # before a suite counted its tasks: the average was over those scored (eight: no LAMBADA-std)
    return {"covered": scored, "of": PAPER_TASKS, "dtype": dtype, **suite}


# -- probe.json -----------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Spread(Record):
    """A measure's mean and sample standard deviation over the probed samples (each nested as one
    sample's value)."""

    mean: list[Any]
    std: list[Any]


@dataclass(kw_only=True)
class ProbeResult(Record):
    """probe.json (meshlm.analysis.probes.probe, with the checkpoint it came from)."""

    checkpoint: str | None = optional()
    step: int | None = None
    label: str | None = optional()  # the run folder's name
    model: dict[str, Any] | None = optional()  # ModelConfig.to_dict()
    dtype: str | None = optional()
    samples: int
    tokens: int
    stages: list[str]  # e, h0 … hK, coda
    blocks: list[str]  # prelude, loop 1 … loop K, coda
    update_core: Spread  # per block: relative update h -> f(h)
    update_state: Spread  # per block: h^t -> h^(t+1)
    cka_rbf: Spread  # stage × stage
    cka_linear: Spread
    spectrum: Spread  # per stage: normalised top singular values
    effective_rank: Spread  # per stage
    write_usage: Spread | None = optional()  # MeSH: per router pair × slot
    read_usage: Spread | None = optional()
    write_entropy: Spread | None = optional()  # per router pair
    read_entropy: Spread | None = optional()
    per_sample: dict[str, list[Any]] = field(default_factory=dict)  # every measure, per sample
    slots: int | None = optional()  # MeSH buffer slots B
    max_entropy: float | None = optional()  # log B

    def cka(self, kernel: str) -> Spread:
        return self.cka_rbf if kernel == "rbf" else self.cka_linear


def upgrade_probe(raw: dict[str, Any]) -> dict[str, Any]:
    """A probe.json of any meshlm version in today's form."""
    return {"dtype": "fp32", **raw}  # before the run policy's autocast: probed in fp32


# -- files ----------------------------------------------------------------------------------------
def read_eval(path: str | Path) -> EvalResult | None:
    """A run's eval.json (any meshlm version's, upgraded); None if there is none."""
    return _read(Path(path), EvalResult, upgrade_eval, "meshlm eval")


def read_probe(path: str | Path) -> ProbeResult | None:
    """A probe.json (any meshlm version's, upgraded); None if there is none."""
    return _read(Path(path), ProbeResult, upgrade_probe, "meshlm probe")


def _read(path: Path, kind: type[R], upgrade, command: str) -> R | None:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise UnreadableResult(f"{path} is unreadable ({err}); re-run the command that wrote "
                               f"it") from None
    try:
        return kind.from_dict(upgrade(raw) if isinstance(raw, dict) else raw)
    except (ResultError, TypeError, AttributeError) as err:
        raise ResultError(f"{path} is not a {command} result ({err}); re-run `{command}` to "
                          f"write it again") from None


def write(record: Record, path: str | Path) -> Path:
    """Atomically (meshlm.atomic): the previous file stays whole until this one is."""
    return atomic.write_text(path, json.dumps(record.to_dict(), indent=1, default=float) + "\n")
