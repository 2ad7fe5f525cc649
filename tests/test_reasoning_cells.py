"""Labelled reasoning tasks (meshlm.reasoning.cells): generators checked by an independent solver,
labels that never reach the inputs, disjoint splits, the labelled loss against a hand-masked
cross-entropy, evaluation by difficulty per position, bad input, and prepare → train → eval → report
end to end."""
from __future__ import annotations

import itertools
import json
import random
import re
import string

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import build, tiny

from meshlm.data.prepare import PreparedData
from meshlm.data.tasks import TaskData, bucket, draw_problems, prepare_tasks, read_test
from meshlm.data.tokenizer import load_tokenizer
from meshlm.errors import ConfigError, DataError
from meshlm.evaluation.reasoning import Positions, evaluate_positions
from meshlm.model.exit import ExitRule
from meshlm.reasoning import TASKS, parse_tasks
from meshlm.train.batches import windows_xy

LABELLED = [name for name, task in TASKS.items() if getattr(task, "labelled", False)]
PERMS = list(itertools.permutations(range(3)))


# -- an independent solver, written from the task descriptions: relax in rounds until every cell
# is known; a cell's difficulty is the round in which it became known (roots: round 0) -----------
def solve(name: str, text: str, modulus: int = 10, named: bool = False) -> tuple[list, list]:
    width = (1 if name in ("chain", "parity", "compose") else 2) + named
    cells = [text[i + named:i + width] for i in range(0, len(text), width)]  # contents
    if named:  # each cell starts with its own name, in capitals
        assert [text[i] for i in range(0, len(text), width)] == list(
            string.ascii_uppercase[:len(cells)])
    value: dict[int, int] = {}
    known_at: dict[int, int] = {}
    letters = {i: [string.ascii_lowercase.index(c) for c in cell if c.isalpha()]
               for i, cell in enumerate(cells)}
    # parity and compose: the letters past the cells' own name a cell with the second operation
    flips = {i: [r >= len(cells) for r in refs] for i, refs in letters.items()}
    named = {i: [r % len(cells) for r in refs] for i, refs in letters.items()}
    for i, refs in named.items():
        if not refs:
            value[i], known_at[i] = int(cells[i][-1]), 0
    round_ = 0
    while len(value) < len(cells):
        round_ += 1
        ready = [i for i in range(len(cells)) if i not in value
                 and all(r in value and known_at[r] < round_ for r in named[i])]
        assert ready, "a cell names a later cell or itself"
        for i in ready:
            refs, cell = named[i], cells[i]
            if name == "chain":
                value[i] = value[refs[0]]
            elif name == "parity":
                value[i] = value[refs[0]] ^ flips[i][0]
            elif name == "compose":  # the parent's permutation, then the swap or the rotation
                p, g = PERMS[value[refs[0]]], [(1, 0, 2), (1, 2, 0)][flips[i][0]]
                value[i] = PERMS.index(tuple(g[p[x]] for x in range(3)))
            elif name == "addmod":
                value[i] = (value[refs[0]] + int(cell[1])) % modulus
            else:  # dagmod
                value[i] = (value[refs[0]] + value[refs[1]]) % modulus
            known_at[i] = round_
    labels, depths = [], []
    for i in range(len(cells)):
        labels += [None] * (width - 1) + [str(value[i]) if named[i] else None]
        depths += [None] * (width - 1) + [known_at[i] if named[i] else None]
    return labels, depths


@pytest.mark.parametrize("name, named", [(n, 0) for n in LABELLED] + [(n, 1) for n in LABELLED])
def test_labels_and_difficulties_are_what_an_independent_solver_says(name, named):
    task, rng = parse_tasks(name, f"{name}.named={named}")[0], random.Random(11)
    length = {len(task.sample(rng, level).text) for level in task.levels}
    assert length == {task.cells * task.width}  # the same length at every difficulty
    for level in task.test_levels:
        for _ in range(40):
            s = task.sample(rng, level)
            assert set(s.text) <= set(task.alphabet)
            labels, depths = solve(name, s.text, getattr(task, "modulus", 10), bool(named))
            assert list(s.labels) == labels == list(task.solve(s.text))
            assert list(s.depths) == depths
            assert s.difficulty == level == task.difficulty(s.text) == max(d or 0 for d in depths)
            # every depth up to the difficulty is present, and the first `roots` cells are roots
            assert set(range(1, level + 1)) <= {d for d in depths if d}
            assert all(lab is None for lab in labels[:task.roots * task.width])


@pytest.mark.parametrize("name", LABELLED)
def test_generators_are_deterministic_under_a_seed(name):
    draw = lambda: [TASKS[name].sample(random.Random(5), k) for k in (1, 3, 6)]  # noqa: E731
    assert draw() == draw()
    assert TASKS[name].sample(random.Random(6), 3) != draw()[1]


def test_compose_is_not_commutative_so_order_matters():
    from meshlm.reasoning.cells import Compose

    task = Compose(cells=8, roots=4, train_depth=2)
    # F = A then the swap (a), then the rotation (m: cell E, second alphabet); H = A then the
    # rotation (i), then the swap (g: cell G)
    labels = task.solve("A1B3C0D0EaFmGiHg")
    assert labels[11] != labels[15] and None not in (labels[11], labels[15])


@pytest.fixture(scope="module")
def chain_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("chain")
    prepare_tasks(TaskData(tasks="chain", train_examples=400, val_examples=40, test_per_level=5),
                  out)
    return out


def test_splits_are_disjoint_and_test_goes_beyond_training():
    drawn = draw_problems(TaskData(tasks="dagmod", train_examples=1500, val_examples=60,
                                   test_per_level=10))
    train, val = {s.text for s in drawn.train}, {s.text for s in drawn.val}
    test = {s.text for _, s in drawn.test}
    assert not (train & val) and not (train & test) and not (val & test)
    assert {bucket(t) for t in test} == {0} and {bucket(t) for t in val} == {1}
    assert max(d for s in drawn.train for d in s.depths if d) == 4
    assert {s.difficulty for _, s in drawn.test} == set(range(1, 9))


def test_a_label_never_appears_in_the_input_stream(chain_data):
    """The token shards hold the cells alone (no answers written after them); targets come from
    the separate label stream, aligned with the inputs: the target of position i is cell i's own
    value, which the next token is not."""
    data = PreparedData(chain_data, "train")
    tok = load_tokenizer(chain_data / "tokenizer.json")
    task = TASKS["chain"]
    block = data.manifest["task"]["block"]
    assert block == 2 * task.cells and data.num_sequences(block) == 400
    x, y = windows_xy(data, list(range(400)), block)
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        text = tok.decode(row_x)
        assert len(text) == 2 * task.cells and set(text) <= set(task.alphabet)  # cells only
        labels = task.solve(text)
        assert [None if t == -100 else tok.decode([t]) for t in row_y] == list(labels)
    # a next-token stream would make most targets the following cell's letter: none is here
    letters = {tok.encode(c)[0] for c in string.ascii_lowercase[:task.cells]}
    assert not letters & set(y[y != -100].tolist())
    assert "labels" in data.manifest and "loss_mask" not in data.manifest


def test_labelled_loss_equals_a_hand_masked_cross_entropy(chain_data):
    data = PreparedData(chain_data, "train")
    tok = load_tokenizer(chain_data / "tokenizer.json")
    block, rows = data.manifest["task"]["block"], [0, 3, 7]
    x, y = windows_xy(data, rows, block)
    model = build(tiny(vocab_size=64, context_length=64))
    loss = model(x, targets=y).loss
    logits = model(x).logits
    hand_targets, chosen = [], torch.zeros_like(x, dtype=torch.bool)
    for row, ids in enumerate(x.tolist()):  # the labels from the text, not from the label stream
        for pos, label in enumerate(TASKS["chain"].solve(tok.decode(ids))):
            if label is not None:
                chosen[row, pos] = True
                hand_targets.append(tok.encode(label)[0])
    hand = F.cross_entropy(logits[chosen], torch.tensor(hand_targets))
    assert loss.item() == pytest.approx(hand.item(), rel=1e-6)
    assert int((y != -100).sum()) == len(hand_targets) == 3 * (TASKS["chain"].cells - 4)


def test_unlabelled_next_gives_every_other_position_its_next_token(chain_data):
    """train.unlabelled=next: a labelled position keeps its label, every other its next token,
    recomputed from the text; the last position (its next token starts another example) none."""
    data = PreparedData(chain_data, "train")
    tok = load_tokenizer(chain_data / "tokenizer.json")
    block, rows = data.manifest["task"]["block"], [0, 5, 9]
    x, labelled = windows_xy(data, rows, block)
    data.unlabelled = "next"
    same_x, y = windows_xy(data, rows, block)
    assert torch.equal(x, same_x)
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        labels = TASKS["chain"].solve(tok.decode(row_x))
        expected = [tok.encode(label)[0] if label is not None else
                    (row_x[pos + 1] if pos + 1 < block else -100)
                    for pos, label in enumerate(labels)]
        assert row_y == expected
    assert torch.equal(y[labelled != -100], labelled[labelled != -100])


def test_unlabelled_next_needs_labelled_data(tmp_path_factory):
    from trainkit import make_prepared

    from meshlm.data.tasks import unlabelled
    from meshlm.train.config import TrainConfig

    text = PreparedData(make_prepared(tmp_path_factory), "train")
    with pytest.raises(ConfigError, match="train.unlabelled=next .* has no labels"):
        unlabelled(text, "next")
    assert unlabelled(text, "ignore") == "ignore"
    with pytest.raises(ConfigError, match="unlabelled='every' must be one of ignore, next"):
        TrainConfig(unlabelled="every").validate()


def test_evaluation_scores_every_labelled_position_by_its_own_difficulty(chain_data):
    tok = load_tokenizer(chain_data / "tokenizer.json")
    records = read_test(chain_data)
    model = build(tiny(vocab_size=64, context_length=64, spec="1+1R2+1"))
    table = evaluate_positions(model, tok, records, [1, 2, 8], [ExitRule.parse("state:0.5")], 4,
                               "1-4", log=lambda _: None)
    positions = Positions.of(tok, records)
    per_depth = {str(d): int((positions.depth == d).sum()) for d in range(1, 9)}
    for row in table["loops"]:
        assert {lv: v["n"] for lv, v in row["levels"].items()} == per_depth
        assert row["n"] == sum(per_depth.values()) == 12 * len(records)
        with torch.no_grad():  # the accuracy is the argmax at the labelled positions
            right = model(positions.x, loops=row["loops"]).logits.argmax(-1) == positions.y
        assert row["acc"] == pytest.approx(right[positions.scored].float().mean().item())
    # stability: the positions of depth <= min(trained loops 2, trained depth 4), at each count
    assert set(table["stability"]) == {"1", "2", "8"}
    assert table["stability"]["2"]["n"] == per_depth["1"] + per_depth["2"]
    exit_row = table["exit"][0]
    assert 1 <= exit_row["answer_loops"] <= 4 and exit_row["n"] == row["n"]
    assert table["unit"] == "position"


@pytest.mark.parametrize("bad, error, message", [
    (dict(tasks="chain,chase"), ConfigError, "mix labelled tasks (chain) with answer-only ones"),
    (dict(tasks="chain", test_levels="1-13"), ConfigError, "outside what task chain makes (1-12)"),
    (dict(tasks="dagmod", train_levels="1-4", test_levels="4-8", disjoint=True), ConfigError,
     "overlap the training"),
    (dict(tasks="chain", options="chain.cells=40"), ConfigError, "need 2 <= cells <= 26"),
    (dict(tasks="dagmod", options="dagmod.modulus=11"), ConfigError, "need 2 <= modulus <= 10"),
])
def test_bad_labelled_specs_get_one_line_errors(bad, error, message, tmp_path):
    with pytest.raises(error, match=re.escape(message)) as err:
        prepare_tasks(TaskData(**bad), tmp_path / "out")
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


def test_a_label_outside_the_vocabulary_is_named(chain_data):
    data = PreparedData(chain_data, "train")
    largest_token = max(int(s.max()) for s in data.shards)
    largest_label = max(int(m[m != 65535].max()) for m in data.labels)
    data.check_ids(max(largest_token, largest_label) + 1)
    if largest_label > largest_token:  # digits sort before letters: a label is never the largest
        with pytest.raises(DataError, match="holds label id"):
            data.check_ids(largest_label)
    labels = np.array(data.labels[0])  # a label id beyond a small vocabulary, tokens inside it
    labels[labels != 65535] = 60
    data.labels = [labels]
    with pytest.raises(DataError, match=r"holds label id 60, but the model's vocabulary has 40 "
                                        r"ids; .* model.vocab_size to at least 61"):
        data.check_ids(40)


def test_task_options_resize_a_labelled_generator():
    chain = parse_tasks("chain", "chain.cells=10,chain.train_depth=3,chain.roots=3")[0]
    assert (chain.cells, chain.levels, chain.train_levels, chain.test_levels) == (
        10, range(1, 8), range(1, 4), range(1, 7))
    assert len(chain.sample(random.Random(0), 7).text) == 20  # each cell: its name, its content


@pytest.mark.slow
def test_prepare_train_eval_by_depth_and_report_end_to_end(tmp_path):
    """A user's path, each command in a fresh process: labelled task data, a few training steps
    with a sampled loop count, eval per position by depth and under exit, report."""
    from trainkit import cli

    data, runs = tmp_path / "chain", tmp_path / "runs"
    prepared = cli("prepare", "task:chain", "--out", str(data), "--train-examples", "64",
                   "--val-examples", "16", "--test-per-level", "3")
    assert prepared.returncode == 0, prepared.stderr
    trained = cli("train", f"train.data={data}", "model.preset=tiny", "model.vocab_size=64",
                  "model.spec=1+1R2+1", f"train.out_dir={runs}", "train.name=chain",
                  "train.global_batch=8", "train.micro_batch=8", "train.steps=3",
                  "train.eval_every=0", "train.save_every=3", "train.eval_windows=8",
                  "train.loops=uniform:1-3", "train.progress=false", "train.tensorboard=false")
    assert trained.returncode == 0, trained.stderr
    assert "x 32 tokens" in trained.stderr  # one sequence of 16 cells a window
    evaluated = cli("eval", str(runs / "chain"), "--loops", "1,2,8", "--exit", "state:0.5")
    assert evaluated.returncode == 0, evaluated.stderr
    result = json.loads((runs / "chain" / "eval.json").read_text())
    chain = result["reasoning"]["tasks"]["chain"]
    assert chain["unit"] == "position" and [r["loops"] for r in chain["loops"]] == [1, 2, 8]
    assert set(chain["loops"][0]["levels"]) == {str(d) for d in range(1, 9)}
    assert chain["loops"][0]["n"] == 24 * 12 and set(chain["stability"]) == {"1", "2", "8"}
    assert "(labels only)" in evaluated.stdout
    report = cli("report", str(runs / "chain"), "--out", str(tmp_path / "report.html"))
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "report.html").read_text()
    assert "Reasoning suite" in page and page.count("<img") >= 5


def test_labelled_data_given_to_fine_tuning_is_named(chain_data):
    from meshlm.data.sft import read_records

    with pytest.raises(DataError, match=r"is a prepared folder \(labelled task data\), which "
                                        r"fine-tuning cannot use; .* `meshlm train train.data="):
        read_records(chain_data)


def test_a_curriculum_opens_one_difficulty_at_a_time_and_is_a_function_of_the_step(chain_data):
    """The training split is written easiest first; train.curriculum=N draws step s's batch from the
    prefix that holds the difficulties opened by s (one every N steps), so a batch never holds a
    problem harder than its step allows, and the same step always gets the same batch (resume)."""
    from meshlm.data.tasks import curriculum
    from meshlm.train.batches import get_batch

    data = PreparedData(chain_data, "train")
    tok = load_tokenizer(chain_data / "tokenizer.json")
    block = data.manifest["task"]["block"]
    x, _ = windows_xy(data, list(range(data.num_sequences(block))), block)
    depth = [TASKS["chain"].difficulty(tok.decode(row)) for row in x.tolist()]
    assert depth == sorted(depth) and set(depth) == {1, 2, 3, 4}
    ends = data.manifest["task"]["train_level_ends"]
    assert ends == {str(k): sum(d <= k for d in depth) for k in (1, 2, 3, 4)}
    for step, top in ((0, 1), (9, 1), (10, 2), (25, 3), (30, 4), (500, 4)):
        n = curriculum(data.manifest, 10, block)(step)
        assert n == ends[str(top)]
        batch = get_batch(data, step, 16, block, seed=0, n_sequences=n)
        (bx, _), = batch
        assert max(TASKS["chain"].difficulty(tok.decode(r)) for r in bx.tolist()) <= top
        again, = get_batch(data, step, 16, block, seed=0, n_sequences=n)
        assert torch.equal(bx, again[0])
    with pytest.raises(ConfigError, match=r"train.curriculum needs task data .* set "
                                          r"train.curriculum=0"):
        curriculum({"format": "text shards"}, 10, block)  # not task data: refused at once
