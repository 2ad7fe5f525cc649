"""Self-speculative decoding: the staged forward, cache rollback, exact greedy output, the sampling
rule."""
import itertools

import pytest
import torch
from conftest import build, tiny

from meshlm.cli import main
from meshlm.errors import ConfigError
from meshlm.generate import Sampling, draw, generate, left_pad, probabilities, rounds
from meshlm.generate import planner as plans
from meshlm.generate.batch import Batch
from meshlm.generate.planner import Planner
from meshlm.generate.rounds import Rounds
from meshlm.generate.speculative import Speculation, SpeculationStats
from meshlm.model import SCHEMES
from meshlm.model.kv_cache import KVCache
from meshlm.model.run import LoopRun

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18]]  # batch 3, left-padded to 7
LOOPED = sorted(set(SCHEMES) - {"vanilla"})
SETTINGS = ["1:3", "2:2", "3:5", "1:1", "2", "auto"]  # K_d:γ, K_d with γ chosen, both chosen


@pytest.mark.parametrize("scheme", sorted(set(SCHEMES) - {"vanilla"}))
def test_a_loop_stopped_joined_and_resumed_equals_the_forward(scheme):
    """Draft runs of one token each, stopped after K_d steps, joined along T and resumed to K: same
    logits as one cached forward over those tokens (the per-token scheme state carries over
    exactly)."""
    model = build(tiny(scheme=scheme, spec="1+2R3+1"))
    schedule, ids = model.config.layout.schedule, torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        reference = model(ids).logits
        cache = KVCache()
        runs = [model.advance(model.enter(ids[:, i:i + 1], cache=cache), schedule, stop=1)
                for i in range(6)]
        joined = model.advance(LoopRun.join(runs), schedule)
        # the resumed loop writes its slots from step 1 on (empty until then) into the draft cache
        assert (model.readout(joined, schedule) - reference).abs().max() <= 1e-5


def test_runs_join_only_when_consecutive_at_one_step():
    """A run knows the tokens cached before it, so joining checks that runs follow each other."""
    model = build(tiny(scheme="mesh", spec="1+2R3+1"))
    schedule, cache = model.config.layout.schedule, KVCache()
    with torch.no_grad():
        first = model.enter(torch.tensor([[5, 6]]), cache=cache)
        second = model.advance(model.enter(torch.tensor([[7]]), cache=cache), schedule, stop=1)
    assert (first.past, second.past) == (0, 2)
    for runs in ([first, second], [second, first]):  # steps 0 and 1; then out of order too
        with pytest.raises(ValueError, match="consecutive runs at one step"):
            LoopRun.join(runs)


def test_readout_of_the_last_positions_is_the_tail_of_the_full_readout():
    """Calibration reads only the positions it compares: the coda still sees every position
    (attention)."""
    model = build(tiny(scheme="mesh", spec="1+2R3+1"))
    ids, schedule = torch.tensor([[5, 6, 7, 8, 9, 10]]), model.config.layout.schedule
    with torch.no_grad():
        full = model.readout(model.advance(model.enter(ids), schedule), schedule)
        tail = model.readout(model.advance(model.enter(ids), schedule), schedule, last=2)
    # the head's matmul over 2 rows instead of 6 may block differently: equal to float rounding
    assert tail.shape == (1, 2, full.shape[-1]) and (tail - full[:, -2:]).abs().max() <= 1e-6


@pytest.mark.parametrize("scheme", ["mesh", "anchor"])
def test_calibration_reads_every_candidate_draft_as_a_draft_does(scheme):
    """The prefill's agreement for each (K_d, readout), all candidates in one batched coda, equals Σ
    min(p, q) of drafts read one at a time: the prompt's earlier positions at full depth, the last
    ones stopped at K_d, their coda seeing the earlier positions' full-depth keys/values; p the full
    model's distribution."""
    model = build(tiny(scheme=scheme, spec="1+2R4+1"))
    schedule, s = model.config.layout.schedule, Sampling(temperature=1.3, top_k=40)
    ids, mask = left_pad(PROMPTS, 1, torch.device("cpu"))
    torch.manual_seed(0)
    # away from the initialisation, where MeSH's final read is close to the loop state
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn_like(weight) * 0.05)
    last, head = plans.PRIOR_TOKENS, ids.shape[1] - plans.PRIOR_TOKENS
    with torch.no_grad():
        _, agreement, positions = Rounds(model, schedule, s).prefill(ids, mask, [1, 3], last)
        p = probabilities(model(ids, padding_mask=mask).logits[:, -last:], s)
        real = mask[:, -last:].bool()
        reads = ([(1, True), (1, False), (3, True), (3, False)] if scheme == "mesh"
                 else [(1, False), (3, False)])
        assert sorted(agreement) == sorted(reads) and positions == int(real.sum())
        for k_d, read in reads:
            cache = KVCache()
            # every slot, earlier positions
            model(ids[:, :head], padding_mask=mask[:, :head], cache=cache)
            run = model.advance(model.enter(ids[:, head:], mask, cache=cache), schedule, stop=k_d)
            if read:
                run.h = model.scheme.early_exit(run.h, run.ctx, len(schedule))
            q = probabilities(model.readout(run, schedule), s)
            expected = float(torch.minimum(p, q).sum(-1)[real].mean())
            assert abs(agreement[(k_d, read)] - expected) <= 1e-5, (k_d, read)
        # the candidates do differ
        assert len({round(a, 4) for a in agreement.values()}) == len(reads)


def test_crop_forgets_the_tail_of_chosen_slots():
    cache = KVCache()
    for slot in range(3):
        cache.update(torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4), slot)
    cache.crop(3, range(1, 3))
    assert [k.shape[-2] for k in cache.keys] == [5, 3, 3]
    cache.crop(2)
    assert [v.shape[-2] for v in cache.values] == [2, 2, 2]



def greedy_both_ways(model, prompts, n, speculate):
    s = Sampling(max_new_tokens=n, temperature=0, stop_at_eos=False)
    stats = SpeculationStats()
    return generate(model, prompts, s), generate(model, prompts, s,
                                                 speculate=Speculation.parse(speculate),
                                                 stats=stats), stats


@pytest.mark.parametrize("scheme", LOOPED)
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_speculation_is_token_for_token_plain_cached_greedy(scheme, batch):
    """Every scheme, batch 1 and batch 3 left-padded, 64 new tokens; the K_d:γ setting varies by
    scheme."""
    model = build(tiny(scheme=scheme, spec="1+2R4+1", context_length=96))
    speculate = SETTINGS[LOOPED.index(scheme) % len(SETTINGS)]
    plain, spec, stats = greedy_both_ways(model, PROMPTS[:batch] if batch == 1 else PROMPTS, 64,
                                          speculate)
    assert spec == plain, (speculate, stats.summary())
    assert all(len(row) == 64 for row in spec)
    assert stats.tokens == 64 * batch and stats.rounds > 0


@pytest.mark.parametrize("scheme", ["mesh", "base"])
def test_auto_is_exact_and_reports_its_choice(scheme):
    model = build(tiny(scheme=scheme, spec="1+2R4+1", context_length=96))
    plain, spec, stats = greedy_both_ways(model, PROMPTS, 64, "auto")
    assert spec == plain
    # calibrated, then timed
    assert stats.setting and stats.acceptance_by_depth and stats.plain_steps >= 1


def planner_with_costs(speculate="auto", new_tokens=100):
    """A planner for `1+2R4+1` whose loop steps took 2 s and enter and readout 0.5 s each (a plain
    token: 9 s, a K_d = 1 draft token 3 s), with a prompt prior of α = 0.9."""
    from meshlm.config import parse_spec

    layout = parse_spec("1+2R4+1")
    planner = Planner(Speculation.parse(speculate), layout, layout.schedule, new_tokens)
    for stage, seconds in [("enter", 0.5), ("readout", 0.5),
                           *[(("step", k), 2.0) for k in range(4)]]:
        for n in (1, 9):
            planner.costs.add(stage, n, seconds)
    assert planner.next() is None  # no plain step timed yet
    for _ in range(plans.PLAIN_SAMPLES):
        planner.costs.add("plain-overhead", 1, 0.0)
    planner.calibrate({(k_d, False): 0.9 for k_d in planner.candidates}, positions=4)
    return planner


def test_auto_starts_a_round_only_if_its_worst_outcome_keeps_the_loss_within_the_budget():
    """A round emits at least one token, so it can lose at most its cost minus one plain token: auto
    shortens γ until that fits in what is left of the budget, and decodes plainly for good when not
    even γ = 1 does."""
    planner = planner_with_costs()
    plain = planner.costs.plain_token()  # 9 s
    budget = plans.LOSS_BUDGET * 100 * plain  # a share of 100 plain tokens
    worst = {g: planner.costs.round(1, g) - plain for g in (1, 2)}
    # γ·3 s of drafts + 2.5 s shared + 6.5 s verifying − 9 s
    assert worst == {1: 3.0, 2: 6.0} and budget > 7.0
    assert planner.next() == (1, plans.EXPLORE_GAMMA)  # the prior says it pays: a short first look
    # one token: 7 s of room left
    planner.observe(1, torch.tensor([0]), 2, seconds=plain + budget - 7.0)
    assert planner.loss == pytest.approx(budget - 7.0)
    assert planner.next() == (1, 2)
    # 5 s left: γ = 2 could lose 6
    planner.observe(1, torch.tensor([1]), 2, seconds=2 * plain + 2.0)
    assert planner.next() == (1, 1)
    planner.observe(1, torch.tensor([0]), 1, seconds=plain + 3.0)  # 2 s left, less than γ = 1's 3
    assert planner.next() is None and planner.plain_for_good and planner.setting == "plain"
    explicit = planner_with_costs("1")  # an explicit K_d speculates whatever it costs
    explicit.observe(1, torch.tensor([0]), 4, seconds=1e6)
    assert explicit.next() is not None


def test_auto_drafts_short_rounds_until_a_depth_has_shown_what_it_accepts():
    planner = planner_with_costs()
    # long drafts predicted
    planner.calibrate({(k_d, False): 0.95 for k_d in planner.candidates}, positions=4)
    k_d, gamma = planner.next()
    assert gamma == plans.EXPLORE_GAMMA < planner.best(k_d, planner.alpha(k_d))[1]
    for _ in range(plans.EXPLORE_TOKENS // gamma):  # every drafted token accepted, in time
        planner.observe(k_d, torch.tensor([gamma]), gamma, seconds=0.0)
    assert planner.next()[1] > plans.EXPLORE_GAMMA


def test_auto_needs_more_to_start_than_to_carry_on():
    """Starting needs a predicted 1.25x, carrying on 1.1x: one unlucky round (a rejection right
    after a fully accepted one) must not end speculation where it pays."""
    starting, speculating = planner_with_costs(), planner_with_costs()
    for planner in (starting, speculating):
        planner.calibrate({(k_d, False): 0.6 for k_d in planner.candidates}, positions=4)
    gain = max(starting.best(k_d, starting.alpha(k_d))[0] for k_d in starting.candidates)
    assert plans.KEEP_GAIN <= gain < plans.MIN_GAIN  # 1.19x
    speculating.choice = (1, 2)  # already speculating
    assert starting.next() is None and starting.plain_for_good
    assert speculating.next() is not None


def test_rejections_rollback_and_compaction_keep_greedy_exact(monkeypatch):
    """A draft that often disagrees (base, K_d = 1), rows accepting different counts, and a context
    so tight that rollback holes must be squeezed out (compact) for the rounds to fit."""
    compactions = []
    original = Batch.compact
    monkeypatch.setattr(Batch, "compact", lambda self: compactions.append(1) or original(self))
    model = build(tiny(scheme="base", spec="1+2R4+1", context_length=7 + 64))
    plain, spec, stats = greedy_both_ways(model, PROMPTS, 64, "1:4")
    assert spec == plain
    assert 0.1 < stats.acceptance < 0.9, stats.summary()  # both paths taken, often
    assert compactions


@pytest.mark.parametrize("final_read", [True, False])
def test_either_draft_readout_is_exact(final_read):
    """MeSH's draft may read its buffer with the final read router or take the loop state: both
    exact."""
    model = build(tiny(scheme="mesh", spec="1+2R4+1", context_length=96))
    plain, spec, stats = greedy_both_ways(model, PROMPTS, 32,
                                          Speculation(2, 3, final_read=final_read))
    assert spec == plain and stats.planner.final_read[2] is final_read


def test_stops_at_eos_like_plain_decoding():
    model = build(tiny(scheme="anchor", spec="1+2R4+1", context_length=96))
    s = Sampling(max_new_tokens=40, temperature=0)
    eos = generate(model, PROMPTS,
                   Sampling(max_new_tokens=40, temperature=0, stop_at_eos=False))[1][5]
    assert generate(model, PROMPTS, s, eos_id=eos, speculate=Speculation(2, 3)) == generate(
        model, PROMPTS, s,
                                                                                eos_id=eos)


# -- sampling: the output distribution is exactly the full model's ---------------------------------
V, L, N = 6, 3, 4000  # vocabulary, continuation length, samples (one batch of N identical prompts)
PROMPT = [2, 3]


@pytest.fixture(scope="module")
def peaked_model():
    """A tiny base model whose K_d = 1 draft disagrees with the full depth often (weights ×3)."""
    model = build(tiny(scheme="base", spec="1+1R3+1", vocab_size=V, d_model=16, n_heads=2), seed=3)
    with torch.no_grad():
        for weight in model.parameters():
            weight.mul_(3.0)
    return model


def exact_distribution(model, s):
    """Probability of each of the V^L continuations under the full model with the filters
    applied."""
    seqs = torch.tensor(list(itertools.product(range(V), repeat=L)))  # (V^L, L)
    ids = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs], 1)
    with torch.no_grad():
        p = probabilities(model(ids).logits[:, len(PROMPT) - 1:-1], s)  # (V^L, L, V)
    return p.gather(-1, seqs[..., None]).squeeze(-1).prod(-1).double()


def chi_square(samples, p):
    """Pearson's statistic of the samples' continuation counts against p (cells expected < 5
    pooled), and the critical value at significance 1e-4 (Wilson–Hilferty)."""
    index = torch.tensor([sum(t * V ** (L - 1 - i) for i, t in enumerate(row)) for row in samples])
    counts = torch.bincount(index, minlength=V ** L).double()
    expected = p * len(samples)
    big = expected >= 5
    stat = ((counts[big] - expected[big]) ** 2 / expected[big]).sum()
    stat += (counts[~big].sum() - expected[~big].sum()) ** 2 / expected[~big].sum().clamp(min=1e-9)
    df = int(big.sum())
    return float(stat), df * (1 - 2 / (9 * df) + 3.719 * (2 / (9 * df)) ** 0.5) ** 3


def resample_from_p(p, q, d, s, generator):
    """A deliberately wrong rule: on rejection draw from p instead of the residual max(0, p − q)."""
    accepted, _ = ORIGINAL_ACCEPT(p, q, d, s, generator)
    b, _, v = q.shape
    p_at = p.gather(1, accepted[:, None, None].expand(b, 1, v)).squeeze(1)  # (B, V)
    return accepted, draw(p_at, s, generator)


ORIGINAL_ACCEPT = rounds.accept


@pytest.mark.parametrize("filters",
                         [dict(temperature=1.0), dict(temperature=0.8, top_k=4, top_p=0.9)])
def test_speculative_sampling_has_the_full_models_distribution(peaked_model, filters, monkeypatch):
    s = Sampling(max_new_tokens=L, seed=1, stop_at_eos=False, **filters)
    p = exact_distribution(peaked_model, s)
    stat, critical = chi_square(generate(peaked_model, [PROMPT] * N, s), p)
    assert stat < critical, ("plain", stat, critical)
    stats = SpeculationStats()
    stat, critical = chi_square(generate(peaked_model, [PROMPT] * N, s, speculate=Speculation(1, 2),
                                         stats=stats), p)
    assert stat < critical, ("speculative", stat, critical)
    # rejections are frequent: the residual matters
    assert 0.2 < stats.acceptance < 0.95, stats.summary()
    monkeypatch.setattr(rounds, "accept", resample_from_p)
    stat, critical = chi_square(generate(peaked_model, [PROMPT] * N, s,
                                         speculate=Speculation(1, 2)), p)
    assert stat > critical, ("the wrong rule passed", stat, critical)


# -- settings, errors, the command line ------------------------------------------------------------
def test_bad_settings_are_one_line_errors():
    looped = build(tiny(spec="1+1R3+1"))
    for text, message in [("3", "K_d=3 must be in 1 … 2"), ("0", "K_d=0 must be in 1"),
                          ("1:0", "γ=0"),
                          ("x", "not auto, K_d or K_d:γ")]:
        with pytest.raises(ConfigError, match=message):
            generate(looped, PROMPTS, Sampling(max_new_tokens=4),
                     speculate=Speculation.parse(text))
    flat = build(tiny(scheme="vanilla", spec="1+1+1+1"))
    with pytest.raises(ConfigError, match="repeats none"):
        generate(flat, PROMPTS, Sampling(max_new_tokens=4), speculate=Speculation())
    with pytest.raises(TypeError, match="pass a Speculation"):  # typed, parsed at the edge
        generate(looped, PROMPTS, Sampling(max_new_tokens=4), speculate="auto")
    assert (Speculation.parse("2:5") == Speculation(2, 5)
            and Speculation.parse("auto") == Speculation())


def test_cli_prints_acceptance_and_speed_on_stderr(tmp_path, capsys):
    from meshlm.checkpoint import save_model

    model = build(tiny(spec="1+1R3+1", vocab_size=8192, context_length=48))
    save_model(model, tmp_path / "ckpt")
    args = ["generate", str(tmp_path / "ckpt"), "Once upon a time", "-n", "12", "-t", "0"]
    assert main(args) == 0
    plain = capsys.readouterr()
    assert main(args + ["--speculate", "1:3"]) == 0
    spec = capsys.readouterr()
    assert spec.out == plain.out  # the text alone on stdout, the same text
    assert "acceptance" in spec.err and "tokens/s" in spec.err
    assert main(args + ["--speculate", "5"]) != 0


def test_hugging_face_generate_speculates_through_the_early_exit_knobs(tmp_path):
    """The exported model: generate(assistant_early_exit=K_d, num_assistant_tokens=γ) and
    speculate="auto" give transformers' own greedy output, left padding included. (With meshlm
    imported, transformers loads the registered class even under trust_remote_code; the folder's own
    code is tested where meshlm cannot be imported, in test_hf.py.)"""
    from transformers import AutoModelForCausalLM

    from meshlm.hf import from_meshlm, save_hf

    model = build(tiny(spec="1+2R4+1", scheme="base", context_length=96))
    hf = from_meshlm(model)
    ids = torch.tensor([[1, 1, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                  eos_token_id=None,
                  pad_token_id=1)
    reference = hf.generate(**common)
    stats = SpeculationStats()
    assert torch.equal(hf.generate(**common, assistant_early_exit=1, num_assistant_tokens=3,
                                   speculation_stats=stats), reference)
    assert stats.rounds and stats.setting == "K_d=1 γ=3"
    assert torch.equal(hf.generate(**common, speculate="auto"), reference)
    with pytest.raises(ValueError, match="num_beams"):
        hf.generate(**common, speculate="auto", num_beams=2)
    save_hf(model, tmp_path / "hf", tokenizer=None)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(loaded.generate(**common, speculate="1:2"), reference)
