"""The reasoning suite: generators checked by independent solvers, disjoint splits, the answer mask
and its loss, the exact-match scorer, bad input, and prepare → train → eval by loops → report end to
end."""
from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import build, tiny

from meshlm.data.prepare import PreparedData
from meshlm.data.tasks import TEST_FILE, TaskData, bucket, draw_problems, prepare_tasks, read_test
from meshlm.data.tokenizer import load_tokenizer
from meshlm.errors import ConfigError
from meshlm.evaluation.reasoning import Answer, binomial, by_level, decode, spearman
from meshlm.model.exit import ExitRule
from meshlm.reasoning import TASKS, parse_levels, parse_tasks
from meshlm.train.batches import windows_xy


# -- independent solvers: written from the task descriptions, sharing no code with
# meshlm.reasoning.tasks --------
def solve_chase(prompt: str) -> tuple[str, int]:
    body, query = re.fullmatch(r"(.*);([a-z])=", prompt).groups()
    table = {m[0]: m[1] for m in re.findall(r"([a-z])=([a-z0-9])", body)}
    hops, name = 1, query
    while not table[name].isdigit():
        name, hops = table[name], hops + 1
    return table[name], hops


def solve_modsum(prompt: str) -> tuple[str, int]:
    digits = [int(c) for c in prompt.rstrip("=")]
    return str(sum(digits) % 10), len([d for d in digits if d])


def solve_addition(prompt: str) -> tuple[str, int]:
    a, b = prompt.rstrip("=").split("+")
    return "".join(reversed(str(int("".join(reversed(a)))
                                + int("".join(reversed(b)))))), max(len(a), len(b))


def solve_dag(prompt: str) -> tuple[str, int]:
    body, query = prompt[:-1].split(";")
    formulas = dict(s.split("=") for s in body.split(","))
    value, depth = {}, {}
    while query not in value:  # relax until every variable whose operands are known is known
        for name, formula in formulas.items():
            terms = formula.split("+")
            if name in value or not all(t.isdigit() or t in value for t in terms):
                continue
            value[name] = sum(int(t) if t.isdigit() else value[t] for t in terms) % 10
            depth[name] = (0 if len(terms) == 1
                           else 1 + max(0 if t.isdigit() else depth[t] for t in terms))
    return str(value[query]), depth[query]


SOLVERS = {"chase": solve_chase, "modsum": solve_modsum, "addition": solve_addition,
           "dag": solve_dag}
ANSWER_TASKS = [name for name, task in TASKS.items() if not getattr(task, "labelled", False)]


def test_every_answer_only_task_has_an_independent_solver():
    assert sorted(ANSWER_TASKS) == sorted(SOLVERS)


@pytest.mark.parametrize("name", ANSWER_TASKS)
def test_every_problem_is_answered_and_labelled_as_an_independent_solver_says(name):
    task, rng = TASKS[name], random.Random(7)
    for level in task.test_levels:
        for _ in range(30):
            p = task.sample(rng, level)
            assert p.prompt.endswith("=") and set(p.prompt + p.answer) <= set(task.alphabet)
            assert (p.answer, p.difficulty) == SOLVERS[name](p.prompt) == (task.solve(p.prompt),
                                                                           task.difficulty(
                                                                               p.prompt))
            assert p.difficulty == level
            if name == "chase":  # the query's digit is one of distractors + 1, never the only one
                assert sum(c.isdigit() for c in p.prompt) == task.distractors + 1


@pytest.mark.parametrize("name", ["chase", "modsum", "dag"])
def test_the_prompt_length_does_not_grow_with_the_difficulty(name):
    task, rng = TASKS[name], random.Random(0)
    lengths = {len(task.sample(rng, level).prompt) for level in task.test_levels for _ in range(5)}
    if name == "dag":  # statements are 3 or 5 characters: bounded, not growing
        assert max(lengths) - min(lengths) <= 2 * task.statements
    else:
        assert len(lengths) == 1


@pytest.mark.parametrize("name", ANSWER_TASKS)
def test_generators_are_deterministic_under_a_seed(name):
    a = [TASKS[name].sample(random.Random(3), 2) for _ in range(3)]
    b = [TASKS[name].sample(random.Random(3), 2) for _ in range(3)]
    assert a == b
    # addition at n=2 is tiny
    assert TASKS[name].sample(random.Random(4), 2) != a[0] or name == "addition"


def test_splits_share_no_problem_and_fill_the_levels_asked_for():
    spec = TaskData(tasks="chase,addition", train_examples=2000, val_examples=100,
                    test_per_level=20)
    drawn = draw_problems(spec)
    train, val = {p.prompt for p in drawn.train}, {p.prompt for p in drawn.val}
    test = {p.prompt for _, p in drawn.test}
    assert not (train & val) and not (train & test) and not (val & test)
    # held-out problems are distinct
    assert len(val) == len(drawn.val) == 100 and len(test) == len(drawn.test)
    assert {bucket(p) for p in test} == {0} and {bucket(p) for p in val} == {1}
    levels = {(t, p.difficulty) for t, p in drawn.test}
    assert levels == {("chase", d) for d in range(1, 9)} | {("addition", d) for d in range(1, 11)}
    # chase's training range
    assert {p.difficulty for p in drawn.train if ";" in p.prompt} == set(range(1, 5))
    assert {p.difficulty for p in drawn.train if "+" in p.prompt} == set(range(1, 7))  # addition's
    ones = [p for t, p in drawn.test if t == "addition" and p.difficulty == 1]
    # 100 one-digit sums exist, ~1/20 of them hash into test: fewer, never shared
    assert 0 < len(ones) < 20
    assert draw_problems(spec).test == drawn.test


@pytest.fixture(scope="module")
def chase_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("chase")
    prepare_tasks(TaskData(tasks="chase", train_examples=300, val_examples=40, test_per_level=4),
                  out)
    return out


def test_task_data_is_one_example_per_window_with_its_answer_masked_in(chase_data):
    data = PreparedData(chase_data, "train")
    tok = load_tokenizer(chase_data / "tokenizer.json")
    block = data.manifest["task"]["block"]
    assert block == 12 * 4 - 1 + 3 + 2 and data.num_sequences(block) == 300
    for i in (0, 17, 299):
        window, targets = data.sequence(i, block), data.inputs_targets([i], block)[1][0]
        text = tok.decode([t for t in window[:-1] if t != tok.pad_id])
        prompt, answer = text.split("=")[:-1], text.rsplit("=", 1)[1]
        scored = targets[targets != -100]
        assert (tok.decode(scored[:-1]) == answer.replace("<|endoftext|>", "")
                and scored[-1] == tok.eos_id)
        assert solve_chase(text[:text.rindex("=") + 1])[0] == tok.decode(scored[:-1]) and prompt
    assert read_test(chase_data) == [json.loads(line)
                                     for line in (chase_data / TEST_FILE).read_text().splitlines()]


def test_answer_only_loss_equals_a_hand_masked_cross_entropy(chase_data):
    data = PreparedData(chase_data, "train")
    tok = load_tokenizer(chase_data / "tokenizer.json")
    block, rows = data.manifest["task"]["block"], [0, 5, 9]
    x, y = windows_xy(data, rows, block)
    model = build(tiny(vocab_size=64, context_length=64))
    loss = model(x, targets=y).loss
    logits = model(x).logits  # (3, block, vocab)
    windows = np.stack([data.sequence(i, block) for i in rows])  # (3, block + 1)
    answer = torch.zeros_like(x, dtype=torch.bool)
    for row, tokens in enumerate(windows):  # found from the text, not from the mask
        # EOS ends the answer (no prompt holds one)
        eos = int(np.flatnonzero(tokens == tok.eos_id)[0])
        last_eq = max(j for j in range(eos) if tok.decode([tokens[j]]) == "=")
        answer[row, last_eq:eos] = True  # inputs whose next token is an answer digit or the EOS
    hand = F.cross_entropy(logits[answer], torch.from_numpy(windows[:, 1:])[answer])
    assert loss.item() == pytest.approx(hand.item(), rel=1e-6)
    assert int((y != -100).sum()) == int(answer.sum()) == 2 * len(rows)  # one digit + EOS each


def test_the_scorer_wants_exactly_the_answer_then_eos():
    class Scripted(torch.nn.Module):  # emits a fixed continuation per prompt, whatever the loops
        def __init__(self, outputs):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.outputs, self.config = outputs, tiny(vocab_size=64)
    tok = _tok()
    problems = [{"prompt": "1+2=", "answer": "3", "difficulty": 1},
                {"prompt": "55+5=", "answer": "501", "difficulty": 2}]
    import meshlm.evaluation.reasoning as reasoning

    def fake_generate(model, prompts, s, eos, pad, **kw):
        return [model.outputs[tok.decode(p)] for p in prompts]

    cases = {  # continuation -> correct?
        "exact": ([tok.encode("3") + [0], tok.encode("501") + [0]], [True, True]),
        "no eos": ([tok.encode("3") + [4], tok.encode("501")], [False, False]),
        "early eos": ([[0], tok.encode("50") + [0]], [False, False]),
        "padding after": ([tok.encode("3") + [0], tok.encode("5") + [1, 1, 1]], [True, False]),
    }
    original = reasoning.generate
    try:
        reasoning.generate = fake_generate
        for continuation, expected in cases.values():
            model = Scripted({p["prompt"]: c for p, c in zip(problems, continuation)})
            assert [a.correct for a in decode(model, tok, problems)] == expected
    finally:
        reasoning.generate = original


def _tok():
    from meshlm.data.tokenizer import TextTokenizer
    from meshlm.reasoning.vocab import build_tokenizer

    return TextTokenizer(build_tokenizer(TASKS["addition"].alphabet), "addition", "x")


def test_binomial_error_levels_and_rank_correlation():
    assert (binomial([True, False, True, True])
            == {"acc": 0.75, "stderr": pytest.approx((0.75 * 0.25 / 4) ** 0.5),
                "n": 4})
    assert spearman([1, 2, 3, 4], [10, 20, 30, 25]) == pytest.approx(0.8)
    # ties: average ranks
    assert spearman([1, 1, 2, 2], [1, 2, 3, 4]) == pytest.approx(0.894427, rel=1e-5)
    # constant loops: no correlation (null in eval.json, not NaN)
    assert spearman([1, 2, 3], [4, 4, 4]) is None
    problems = [{"prompt": "ab", "difficulty": d} for d in (1, 1, 2)]
    answers = [Answer(True, 4, [2]), Answer(False, 6, [4, 3]), Answer(True, 2, [1])]
    levels = by_level(problems, answers, True)
    assert levels["1"]["acc"] == 0.5 and levels["1"]["answer_loops"] == 3.0
    # positions: 2 prompt tokens each (answer_loops[0] is the last of them), then the fed answer
    # tokens
    assert levels["1"]["avg_loops"] == pytest.approx((4 + 6 + 3) / (2 + 2 + 1))


def test_greedy_answers_in_a_batch_equal_answers_alone():
    tok = _tok()
    model = build(tiny(vocab_size=64, context_length=64, spec="1+1R3+1"))
    problems = [TASKS["addition"].sample(random.Random(i), 1 + i % 4) for i in range(6)]
    problems = [{"prompt": p.prompt, "answer": p.answer, "difficulty": p.difficulty}
                for p in problems]
    from meshlm.generate import Sampling, generate
    alone = [generate(model, [tok.encode(p["prompt"])], Sampling(max_new_tokens=6, temperature=0),
                      0, 1,
                      loops=2)[0] for p in problems]
    batched = generate(model, [tok.encode(p["prompt"]) for p in problems],
                       Sampling(max_new_tokens=6, temperature=0),
                       0, 1, loops=2)
    assert batched == alone


@pytest.mark.parametrize("bad, message", [
    (dict(tasks="sudoku"), "unknown reasoning task sudoku"),
    (dict(tasks="chase", train_levels="0-4"), "outside what task chase makes (1-8)"),
    (dict(tasks="modsum", test_levels="1-40"), "outside what task modsum makes (1-12)"),
    (dict(tasks="chase", train_levels="1-4", test_levels="3-8", disjoint=True),
     "overlap the training"),
    (dict(tasks="chase", train_examples=0), "train_examples=0 must be >= 1"),
])
def test_bad_task_specs_get_one_line_errors(bad, message, tmp_path):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        prepare_tasks(TaskData(**bad), tmp_path / "out")
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()


def test_levels_and_task_lists_parse():
    assert (parse_levels("3-5", TASKS["chase"]) == range(3, 6)
            and parse_levels("2", TASKS["dag"]) == range(2, 3))
    assert [t.name for t in parse_tasks("dag, chase")] == ["dag", "chase"]
    with pytest.raises(ConfigError, match="twice"):
        parse_tasks("chase,chase")


@pytest.mark.slow
def test_prepare_train_eval_by_loops_and_report_end_to_end(tmp_path):
    """The path a user takes, each command in a fresh process: prepare task data, train a few steps
    with a sampled loop count (answer-only loss), eval by loops and under exit, report."""
    from trainkit import cli

    data, runs = tmp_path / "chase", tmp_path / "runs"
    prepared = cli("prepare", "task:chase", "--out", str(data), "--train-examples", "64",
                   "--val-examples", "16",
                   "--test-per-level", "3")
    assert prepared.returncode == 0, prepared.stderr
    assert "one example per window of 52 tokens" in prepared.stdout
    trained = cli("train", f"train.data={data}", "model.preset=tiny", "model.vocab_size=64",
                  "model.spec=1+1R2+1",
                  f"train.out_dir={runs}", "train.name=chase", "train.global_batch=8",
                  "train.micro_batch=8",
                  "train.steps=3", "train.eval_every=0", "train.save_every=3",
                  "train.eval_windows=8",
                  "train.loops=uniform:1-3", "train.progress=false", "train.tensorboard=false")
    assert trained.returncode == 0, trained.stderr
    # the window is the task's example block (train.seq_len was 0)
    assert "x 52 tokens" in trained.stderr
    ppl, unigram = map(float, re.search(r"perplexity ([\d.]+) .*unigram baseline ([\d.]+)",
                                        trained.stdout).groups())
    assert unigram < 12 and ppl > 1  # answers only: 10 digits and EOS (all 43 ids would give ~20)
    evaluated = cli("eval", str(runs / "chase"), "--loops", "1,2,4", "--exit", "state:0.5",
                    "--limit", "3")
    assert evaluated.returncode == 0, evaluated.stderr
    result = json.loads((runs / "chase" / "eval.json").read_text())
    chase = result["reasoning"]["tasks"]["chase"]
    assert [row["loops"] for row in chase["loops"]] == [1, 2, 4]
    assert all(set(row["levels"]) == {str(d) for d in range(1, 9)}
               and row["n"] == 24 for row in chase["loops"])
    assert chase["exit"][0]["exit"] == "state:0.5" and 1 <= chase["exit"][0]["avg_loops"] <= 2
    assert result["reasoning"]["train_loops"] == "uniform:1-3"
    # --limit 3 windows, each scoring a digit and EOS
    assert result["perplexity"]["tokens"] == 3 * 2
    # the character tokenizer's runs take the reasoning suite instead
    assert not result["downstream"]
    # a quick look afterwards
    narrower = cli("eval", str(runs / "chase"), "--loops", "1", "--limit", "1")
    assert narrower.returncode == 0 and "so it stays; these results go to eval-" in narrower.stdout
    # the wider results are not replaced
    assert json.loads((runs / "chase" / "eval.json").read_text()) == result
    report = cli("report", str(runs / "chase"), "--out", str(tmp_path / "report.html"))
    assert report.returncode == 0, report.stderr
    page = (tmp_path / "report.html").read_text()
    assert "Reasoning suite" in page and page.count("<img") >= 4 and "beyond, best K'" in page


@pytest.mark.parametrize("scheme", ["base", "anchor", "mesh"])
def test_task_training_with_sampled_depth_resumes_bit_exactly(chase_data, tmp_path, scheme):
    """Answer-only loss, a sampled loop count and truncated backprop on task data, cut after a
    checkpoint and resumed: the same losses as the uninterrupted run (on CPU in fp32, bit for
    bit)."""
    import shutil

    from trainkit import run_dir, tiny_train, train_losses

    from meshlm.train.trainer import train

    common = dict(model={"preset": "tiny", "vocab_size": 64, "scheme": scheme, "spec": "1+1R2+1"},
                  seq_len=0,
                  steps=6, save_every=3, loops="uniform:1-4", backprop_loops=2, dtype="fp32")
    ref = train(tiny_train(chase_data, tmp_path / "ref", **common), log=lambda m: None)
    cfg = tiny_train(chase_data, tmp_path / "cut", **common)
    train(cfg, log=lambda m: None)
    shutil.rmtree(run_dir(cfg) / "step-000006")  # as if killed after the step-3 checkpoint
    resumed = train(cfg, resume=True, log=lambda m: None)
    assert resumed.start_step == 3 and train_losses(run_dir(cfg)) == train_losses(ref.run_dir)
    # ~ln(43) at most: answers only
    assert all(0 < loss < 5 for loss in train_losses(ref.run_dir).values())


@pytest.mark.parametrize("scheme",
                         ["vanilla", "base", "residual", "anchor", "anchor-emb", "static-mix",
                          "dynamic-mix", "mesh"])
def test_every_scheme_is_scored_by_loops_and_exit(chase_data, scheme):
    from meshlm.evaluation.reasoning import evaluate_reasoning

    tok = load_tokenizer(chase_data / "tokenizer.json")
    model = build(tiny(vocab_size=64, scheme=scheme,
                       spec="4" if scheme == "vanilla" else "1+1R2+1"))
    result = evaluate_reasoning(model, tok, read_test(chase_data),
                                {"chase": {"train": "1-4", "test": "1-8"}},
                                [1, 3], [ExitRule.parse("state:0.2")], None, limit=2,
                                log=lambda m: None)
    chase = result["tasks"]["chase"]
    if scheme == "vanilla":  # one depth, no loop to leave
        assert [r["loops"] for r in chase["loops"]] == [1] and chase["exit"] == []
    else:
        assert [r["loops"] for r in chase["loops"]] == [1, 3] and chase["exit"][0]["max_loops"] == 2
        assert 1 <= chase["exit"][0]["avg_loops"] <= 2
    assert all(r["n"] == 16 and 0 <= r["acc"] <= 1 for r in chase["loops"])


def test_task_options_resize_a_generator_and_bad_ones_are_named():
    [chase] = parse_tasks("chase", "chase.statements=8,chase.distractors=3")
    assert (chase.statements, chase.distractors, chase.levels) == (8, 3, range(1, 6))
    p = chase.sample(random.Random(0), 5)
    assert len(p.prompt) == 8 * 4 - 1 + 3 and solve_chase(p.prompt) == (p.answer, 5)
    assert parse_tasks("chase")[0] is TASKS["chase"]  # no options: the registered defaults
    for options, message in [("chase.size=8", "task chase has no option size; its options: "
                                              "statements, distractors"),
                             ("dag.statements=8", "not TASK.KNOB=N for a task given (chase)"),
                             ("chase.statements=2", "need 1 <= distractors < statements")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_tasks("chase", options)
    a, b = TaskData(tasks="chase"), TaskData(tasks="chase",
                                             options="chase.statements=8,chase.distractors=3")
    assert a.key() != b.key()  # other data: another cache folder
