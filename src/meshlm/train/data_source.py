"""A training run's prepared data: where they come from and whether they fit the run.

`prepared_dir` is the plan's folder, or the embedded corpus prepared once into the cache with the
run's tokenizer (rank 0 first, the others then find it). `data_problems` is the one check of a
prepared folder against the plan (preflight collects it with every other problem before any
compute; the trainer runs it on the folder it opens, so the embedded corpus is checked too), and
`open_data` its raising form, which returns the splits and the window length.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshlm.data.prepare import PreparedData, prepare_default
from meshlm.data.tasks import window_length
from meshlm.data.tokenizer import check_vocab
from meshlm.errors import Problems
from meshlm.train import parallel
from meshlm.train.footprint import schedule_problem
from meshlm.train.plan import RunPlan
from meshlm.train.reveal import check_reveal


@dataclass(frozen=True)
class RunData:
    train: PreparedData
    val: PreparedData
    seq_len: int  # the training window: the plan's, or example data's block


def prepared_dir(plan: RunPlan, env: parallel.Env) -> Path:
    """The prepared-data dir: the plan's, else the embedded corpus (prepared once with the run's
    tokenizer, rank 0 first)."""
    if plan.data_dir is not None:
        return plan.data_dir
    source = plan.tokenizer_source
    return _main_rank_first(env, lambda main: prepare_default(tokenizer=source, progress=main))


def open_data(plan: RunPlan, path: Path) -> RunData:
    """Both splits of `path`, checked against the plan (data_problems); one error naming every
    problem."""
    p = Problems()
    data = data_problems(p, plan, path)
    p.raise_if_any()
    assert data is not None  # no problem recorded: both splits opened
    return data


def data_problems(p: Problems, plan: RunPlan, path: Path | None) -> RunData | None:
    """Record in `p` what keeps `path` from training the plan's model: the tokenizer's vocabulary,
    then (for a folder; None is the embedded corpus, not prepared yet) a split that does not open
    (sizes, checksums) or is shorter than a window, ids beyond the vocabulary, another tokenizer,
    example data beyond the context, a step count that repeats the data absurdly. The opened
    splits, or None when they could not be opened."""
    p.check(check_vocab, plan.model.vocab_size, plan.tokenizer)
    if path is None:
        p.need(not plan.cfg.reveal, f"train.reveal={plan.cfg.reveal} hides the given values of "
                                    "labelled task data, but the embedded corpus is text; set "
                                    "train.data to a labelled task (task:chain) or train.reveal=0")
        return None
    if not p.need(path.is_dir(), f"train.data={plan.cfg.data}: {path} does not exist; run "
                                 f"`meshlm prepare` or set train.data=default"):
        return None
    splits = [data for split in ("train", "val")
              if (data := p.check(PreparedData, path, split)) is not None]
    if not splits:
        return None
    manifest, context = splits[0].manifest, plan.model.context_length
    seq_len = p.check(window_length, manifest, plan.cfg.seq_len) or plan.seq_len
    p.need(seq_len <= context, f"the task data's examples are {seq_len} tokens but the model's "
                               f"context_length is {context}; set model.context_length={seq_len} "
                               f"or more")
    windows = []
    for data in splits:
        windows.append(p.check(data.num_sequences, seq_len))
        p.check(data.check_ids, plan.model.vocab_size)
    if not plan.tokenizer.made(manifest["tokenizer"]):
        p.need(False, f"{path} was prepared with tokenizer {manifest['tokenizer']['name']!r}, not "
                      f"{plan.tokenizer.name!r}; set train.tokenizer to match or prepare the data "
                      f"again")
    p.check(check_reveal, plan, splits[0])  # train.reveal: its scheme, labels and tokenizer
    if len(splits) < 2:
        return None
    if windows[0] and (absurd := schedule_problem(plan.cfg, plan.total_steps, windows[0])):
        p.need(False, absurd)  # e.g. steps=1e12: its warmup alone is 1e10 steps
    return RunData(splits[0], splits[1], seq_len)


def _main_rank_first(env: parallel.Env, make: Callable[[bool], Path]) -> Path:
    """Cached data: rank 0 makes it (`make(True)`: with progress) while the others wait, then they
    find it."""
    path = make(True) if env.is_main else None
    parallel.barrier(env)
    return path or make(False)
