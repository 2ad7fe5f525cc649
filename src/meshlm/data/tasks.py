"""Reasoning-task data (meshlm.reasoning) as ordinary prepared data plus an answer mask and a test
set.

    meshlm prepare task:chase --out data/chase             # or train.data=task:chase (prepared into
                                                             the cache)

A task folder is example data (meshlm.data.examples) with a test set:
- every example is one block of `block` tokens, `prompt answer EOS` then padding, so window i
  (seq_len = block) is example i alone: no example attends to another, and positions start at 0 in
  each;
- its loss mask is 1 where the token is part of the answer (its digits and the EOS after them).
  Training and validation take the loss on those targets only;
- test.jsonl: {"task", "prompt", "answer", "difficulty"} per problem, difficulties up to beyond the
  training range, for exact-match evaluation by greedy decoding (meshlm.evaluation.reasoning).
  tokenizer.json is the suite's character tokenizer (meshlm.reasoning.vocab), which training picks
  up from the folder.

Splits never share a problem: each distinct prompt belongs to one split by a hash of its text (test
1/20, validation 1/20, train the rest), so a problem space smaller than the request (addition at one
digit has 100 problems) gives fewer test problems instead of overlap. Test and validation problems
are distinct within their split; training draws may repeat. Training difficulties are drawn
uniformly over the training range.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from meshlm.data.cache_dir import cache_dir as resolve_cache
from meshlm.data.examples import build_cached, example_block, write_split
from meshlm.data.shards import FORMAT, MANIFEST, read_manifest, staged, write_manifest
from meshlm.data.tokenizer import TextTokenizer
from meshlm.errors import ConfigError, DataError
from meshlm.reasoning import Problem, Sequence, Task, parse_levels, parse_tasks, range_text
from meshlm.reasoning.vocab import TOKENIZER_FILE, write_tokenizer

PREFIX = "task:"
GENERATOR_VERSION = 3  # bump when a generator's output changes: cached task data is keyed by it
TEST_FILE = "test.jsonl"
BUCKETS = 20  # hash buckets of a prompt: 0 = test, 1 = validation, the rest = train
TEST_BUCKET, VAL_BUCKET = 0, 1
IGNORE = -100  # cross-entropy's ignore_index: a position without a target
MAX_DRAWS = 200  # draws per wanted problem before a small problem space is accepted as exhausted


@dataclass
class TaskData:
    """What to generate: tasks, difficulty ranges (per task, "LO-HI"; empty = the task's default),
    sizes."""

    tasks: str = "chase"
    options: str = ""  # generator knobs, "chase.statements=8,chase.distractors=3"
    # (meshlm.reasoning.parse_tasks)
    train_levels: str = ""
    test_levels: str = ""
    train_examples: int = 50_000
    val_examples: int = 512
    test_per_level: int = 200
    seed: int = 0
    disjoint: bool = False  # the test range must not overlap the training range

    def resolved(self) -> list[tuple[Task, range, range]]:
        """(task, training levels, test levels) per task; ConfigError for an unknown task, a range
        the generator does not support, or (disjoint) ranges that overlap."""
        out = []
        for task in parse_tasks(self.tasks, self.options):
            train = parse_levels(self.train_levels or task.train_levels, task,
                                 "training difficulty")
            test = parse_levels(self.test_levels or task.test_levels, task, "test difficulty")
            if self.disjoint and set(train) & set(test):
                raise ConfigError(f"task {task.name}: test difficulties {range_text(test)} overlap "
                                  f"the training difficulties {range_text(train)}, but disjoint "
                                  "ranges were asked for; start the test range above "
                                  f"{train.stop - 1} or drop --disjoint")
            out.append((task, train, test))
        kinds = {is_labelled(task) for task, _, _ in out}
        if len(kinds) > 1:
            raise ConfigError(f"tasks {self.tasks} mix labelled tasks ("
                              f"{', '.join(t.name for t, _, _ in out if is_labelled(t))}) with "
                              "answer-only ones; prepare them into separate folders")
        sizes = {"train_examples": self.train_examples, "val_examples": self.val_examples,
                 "test_per_level": self.test_per_level}
        small = [f"{k}={v}" for k, v in sizes.items() if v < 1]
        if small:
            raise ConfigError(f"task data sizes {', '.join(small)} must be >= 1")
        return out

    def key(self) -> str:
        """Identity of the generated data (the cache folder's name)."""
        text = json.dumps({**asdict(self), "version": GENERATOR_VERSION}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def is_labelled(task: Task) -> bool:
    """Whether a task gives a target at every position (meshlm.reasoning.cells) rather than one
    answer."""
    return getattr(task, "labelled", False)


def text_of(problem: Problem | Sequence) -> str:
    """What the model reads: a problem's prompt, a labelled sequence's text."""
    return problem.prompt if isinstance(problem, Problem) else problem.text


def bucket(prompt: str) -> int:
    return int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16) % BUCKETS


@dataclass
class Drawn:
    train: list[Problem | Sequence] = field(default_factory=list)
    val: list[Problem | Sequence] = field(default_factory=list)
    test: list[tuple[str, Problem | Sequence]] = field(default_factory=list)  # (task name, problem)


def draw_problems(spec: TaskData) -> Drawn:
    """Every split's problems, deterministic under spec.seed (each task and split has its own
    stream)."""
    resolved, drawn = spec.resolved(), Drawn()
    for i, (task, train, test) in enumerate(resolved):
        share = [total // len(resolved) + (i < total % len(resolved))
                 for total in (spec.train_examples,
                               spec.val_examples)]
        drawn.train += _draw_split(task, f"{spec.seed}:{task.name}:train", train, share[0], None)
        drawn.val += _draw_split(task, f"{spec.seed}:{task.name}:val", train, share[1], VAL_BUCKET)
        for level in test:
            drawn.test += [(task.name, p)
                           for p in _draw_split(task, f"{spec.seed}:{task.name}:test:{level}",
                                                range(level, level + 1),
                                                spec.test_per_level,
                                                TEST_BUCKET)]
    # a mixture's tasks interleave in the token stream
    random.Random(f"{spec.seed}:mix").shuffle(drawn.train)
    return drawn


def _draw_split(task: Task, stream: str, levels: range, n: int,
                want_bucket: int | None) -> list[Problem]:
    """n problems at difficulties drawn uniformly from `levels`, from the random stream named
    `stream`, whose prompt hashes into `want_bucket` (None: train, any bucket but test's and
    validation's); distinct ones for the held-out splits. Fewer when the problem space runs out."""
    rng, out, seen = random.Random(stream), [], set()
    for _ in range(n * MAX_DRAWS):
        if len(out) == n:
            break
        problem = task.sample(rng, rng.choice(levels))
        text = text_of(problem)
        b = bucket(text)
        if want_bucket is None:
            if b not in (TEST_BUCKET, VAL_BUCKET):
                out.append(problem)
        elif b == want_bucket and text not in seen:
            seen.add(text)
            out.append(problem)
    return out


def prepare_tasks(spec: TaskData, out_dir: str | os.PathLike, overwrite: bool = False) -> dict:
    """Generate `spec` into out_dir (tokens + answer masks, test.jsonl, tokenizer.json,
    manifest.json last)."""
    resolved = spec.resolved()  # bad input fails before the folder is touched
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DataError(f"output {out} is a file; pass a folder path")
    if (out / MANIFEST).exists() and not overwrite:
        raise DataError(f"output folder {out} already holds prepared data; pass --overwrite or "
                        "another folder")
    out.mkdir(parents=True, exist_ok=True)
    with staged(out) as staging:  # the old data stay until the new are complete
        return _write(spec, resolved, staging)


def _write(spec: TaskData, resolved, out: Path) -> dict:
    tok = write_tokenizer(out / TOKENIZER_FILE, "".join(task.alphabet for task, _, _ in resolved))
    drawn = draw_problems(spec)
    if not drawn.train or not drawn.val:
        raise DataError(f"task data {spec.tasks}: the training range made no validation problems; "
                        "widen --train-difficulty or raise --val-examples")
    labelled = is_labelled(resolved[0][0])

    def encode(p: Problem | Sequence) -> tuple[list[int], list[int]]:
        if labelled:  # the inputs, and the target of each position (never an input)
            return encode_labelled(tok, p)[:2]
        # `prompt answer EOS`, the loss on the answer and its EOS (next-token targets)
        prompt, answer = tok.encode(p.prompt), tok.encode(p.answer) + [tok.eos_id]
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)

    # the training split in order of difficulty (stable), so that a curriculum (train.curriculum,
    # `curriculum`) is a prefix of it; the trainer's epoch permutations shuffle it otherwise
    drawn.train.sort(key=lambda p: p.difficulty)
    ends = {str(level): sum(p.difficulty <= level for p in drawn.train)
            for level in sorted({p.difficulty for p in drawn.train})}
    encoded = {"train": [encode(p) for p in drawn.train], "val": [encode(p) for p in drawn.val]}
    block = max(len(ids) for rows in encoded.values() for ids, _ in rows)
    splits, sides = {}, {}
    for split, rows in encoded.items():
        splits[split], sides[split] = write_split(out, split, rows, block, tok.pad_id,
                                                  np.dtype(np.uint16), labels=labelled)
    with open(out / TEST_FILE, "w", encoding="utf-8") as f:
        for name, p in drawn.test:
            record = ({"task": name, "text": p.text, "labels": list(p.labels),
                       "depths": list(p.depths)} if labelled
                      else {"task": name, "prompt": p.prompt, "answer": p.answer})
            f.write(json.dumps({**record, "difficulty": p.difficulty}) + "\n")
    manifest = {
        "format": FORMAT,
        "tokenizer": {"name": TOKENIZER_FILE, "hash": tok.hash, "vocab_size": tok.vocab_size,
                      "eos_id": tok.eos_id,
                      "pad_id": tok.pad_id, "file": TOKENIZER_FILE},
        "dtype": "uint16", "source": PREFIX + spec.tasks, "val_fraction": 0.0,
        "documents": len(drawn.train) + len(drawn.val), "replaced_bytes": 0,
        "splits": splits, ("labels" if labelled else "loss_mask"): sides,
        "task": {**asdict(spec), "block": block, "version": GENERATOR_VERSION,
                 "labelled": labelled, "train_level_ends": ends,
                 "levels": {task.name: {"train": range_text(train), "test": range_text(test)}
                            for task, train, test in resolved},
                 "test_problems": len(drawn.test),
                 "longest_test": max((len(encode(p)[0]) for _, p in drawn.test), default=0)},
    }
    write_manifest(out, manifest)
    return manifest


def opened(levels: list, step: int, every: int) -> list:
    """The difficulties (`levels`, lowest first) a curriculum has opened at `step`: one every
    `every` steps from the lowest."""
    return levels[:1 + step // every]


def unlabelled(data, choice: str) -> str:
    """train.unlabelled=`choice` for training data `data` (a PreparedData): "next" needs labelled
    task data (ConfigError otherwise, in one line with the fix)."""
    if choice == "next" and data.labels is None:
        raise ConfigError(f"train.unlabelled=next gives the positions without a label their next "
                          f"token, but {data.dir} has no labels (text or answer-mask data, which "
                          "train on next tokens or answers already); drop train.unlabelled or "
                          "train on labelled task data (meshlm prepare task:chain)")
    return choice


def curriculum(manifest: dict, every: int, seq_len: int) -> Callable[[int], int]:
    """train.curriculum=`every` over prepared task data: step -> the training windows (of `seq_len`
    tokens) its batch draws from, the prefix of the difficulty-sorted split that holds the
    difficulties opened by then. Data without those counts are refused here, before training."""
    task = manifest.get("task") or {}
    ends = task.get("train_level_ends")
    if not ends:
        raise ConfigError("train.curriculum needs task data prepared by this meshlm "
                          "(train.data=task:NAME or meshlm prepare task:NAME, which order "
                          "training problems by difficulty); set train.curriculum=0 for other data")
    levels, block = sorted(ends, key=int), task["block"]
    return lambda step: max(1, ends[opened(levels, step, every)[-1]] * block // seq_len)


Encoded = tuple[list[int], list[int], list[int]]  # input ids, target per position, difficulty per
# position (IGNORE and -1 where a position has no target)


def encode_labelled(tok: TextTokenizer, seq: Sequence) -> Encoded:
    """A labelled sequence (meshlm.reasoning.cells) as inputs, a target at every labelled position
    (the label itself, not the next token) and each target's difficulty."""
    ids = tok.encode(seq.text)
    if len(ids) != len(seq.text):
        raise DataError(f"the tokenizer does not give one id per character of {seq.text!r}")
    targets = [IGNORE if label is None else tok.encode(label)[0] for label in seq.labels]
    return ids, targets, [-1 if d is None else d for d in seq.depths]


def encode_answer(tok: TextTokenizer, problem: Problem) -> Encoded:
    """An answer-only problem as `prompt answer EOS`, the targets at the positions that predict the
    answer's tokens and its EOS, each with the problem's difficulty."""
    prompt, answer = tok.encode(problem.prompt), tok.encode(problem.answer) + [tok.eos_id]
    before = [IGNORE] * (len(prompt) - 1)
    return (prompt + answer, before + answer + [IGNORE],
            [-1] * len(before) + [problem.difficulty] * len(answer) + [-1])


def stack(rows: list[Encoded], pad_id: int) -> tuple:
    """Encoded rows right-padded into three int64 arrays (B, T): inputs, targets, difficulties (as
    torch tensors when torch is imported by the caller: `torch.as_tensor` each)."""
    width = max(len(ids) for ids, _, _ in rows)
    out = [np.full((len(rows), width), fill, np.int64) for fill in (pad_id, IGNORE, -1)]
    for i, row in enumerate(rows):
        for array, values in zip(out, row):
            array[i, :len(values)] = values
    return tuple(out)


def task_info(data_dir: str | os.PathLike) -> dict | None:
    """The manifest's "task" section (None for text data)."""
    return read_manifest(data_dir).get("task")


def read_test(data_dir: str | os.PathLike) -> list[dict]:
    path = Path(data_dir) / TEST_FILE
    if not path.is_file():
        raise DataError(f"{data_dir} holds no reasoning test set ({TEST_FILE}); pass task data "
                        "written by `meshlm prepare task:NAME`")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def is_task_source(data: str) -> bool:
    return str(data).startswith(PREFIX)


def cached_task_data(data: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """`task:chase[,dag]` with the default sizes and ranges, generated once into the cache; returns
    its folder. Several processes may ask at once: each writes a private folder and renames it into
    place."""
    spec = TaskData(tasks=data[len(PREFIX):])
    spec.resolved()
    target = resolve_cache(cache_dir) / "prepared" / f"task-{spec.key()}"
    return build_cached(target, lambda folder: prepare_tasks(spec, folder, overwrite=True))


def data_folder(data: str) -> Path | None:
    """The prepared folder `train.data` names: a `task:` source's cache folder (generated on first
    use), a folder, or None for the embedded corpus."""
    if data == "default":
        return None
    return cached_task_data(data) if is_task_source(data) else Path(data).expanduser()


def data_tokenizer(folder: Path | None) -> str | None:
    """The tokenizer.json that a prepared folder (`data_folder`) carries, as task data do: training
    uses it unless train.tokenizer says otherwise."""
    if folder is None or not (folder / MANIFEST).is_file():
        return None
    name = read_manifest(folder)["tokenizer"].get("file")
    return str(folder / name) if name else None


def window_length(manifest: dict, seq_len: int) -> int:
    """The training window length: for example data (task or fine-tuning data) its block
    (train.seq_len must be 0 or equal it, since a window is one example), else `seq_len`."""
    block = example_block(manifest)
    if block is None or seq_len in (0, block):
        return block or seq_len
    kind = "task" if "task" in manifest else "fine-tuning"
    raise ConfigError(f"train.seq_len={seq_len} does not fit the {kind} data: each example is one "
                      f"window of {block} tokens; set train.seq_len={block} (or 0)")


def holds_tasks(data: str | os.PathLike) -> bool:
    """Whether `data` (a train.data value or a folder) is reasoning-task data; reads only its
    manifest."""
    if is_task_source(str(data)):
        return True
    if str(data) == "default":  # the embedded corpus, not a folder of that name
        return False
    path = Path(data).expanduser() / MANIFEST
    try:
        return path.is_file() and "task" in json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
