"""Per-token adaptive exit: τ = 0 is full depth, τ = ∞ is one loop, cached == uncached, compute is
skipped, and a criterion defined outside meshlm (one class and its registration) runs end to end."""
import pytest
import torch
from conftest import build, tiny
from test_memory import randomise_routers

from meshlm.errors import ConfigError
from meshlm.model import exit as exit_module
from meshlm.model.exit import CRITERIA, Criterion, ExitRule, ProbeKL, Seen, register_criterion
from meshlm.model.exit_tokens import Gathered
from meshlm.model.kv_cache import KVCache

LOOPS = 4


def model_for(scheme="mesh"):
    model = build(tiny(spec="1+1R2+1", scheme=scheme, max_loops=LOOPS))
    if scheme == "mesh":
        randomise_routers(model)  # far from uniform: tokens converge at different steps
    return model


def x_batch(b=3, t=10, seed=0):
    return torch.randint(0, 97, (b, t), generator=torch.Generator().manual_seed(seed))


def measured(model, x, criterion, step):
    """The criterion's value per token after loop step `step` + 1, from a full-depth forward."""
    kind = CRITERIA[criterion]
    with torch.no_grad():
        states = model(x, loops=LOOPS, return_states=True).stages.states
        rope = model.rotary(torch.arange(x.shape[1])[None], states[0].dtype)
        before, after = states[step], states[step + 1]
        probes = [model.head(model.coda(s, rope, None)) for s in (after, before)] if kind.probes \
            else [None, None]
        return kind(0.0).measure(Seen(before, after, *probes)).flatten()


def mid_threshold(model, x, criterion, step=1):
    """A τ that splits the tokens at `step` and sits far from every token's value (no float-rounding
    ties)."""
    v = measured(model, x, criterion, step).sort().values
    gaps = v[1:] - v[:-1]
    middle = len(v) // 2
    i = middle - 3 + int(gaps[middle - 3:middle + 3].argmax())  # the widest gap near the median
    return ((v[i] + v[i + 1]) / 2).item()


@pytest.mark.parametrize("scheme", ["mesh", "base", "anchor"])
@pytest.mark.parametrize("criterion", ["state", "kl"])
def test_threshold_zero_is_full_depth_and_infinity_is_one_loop(scheme, criterion):
    model, x = model_for(scheme), x_batch()
    with torch.no_grad():
        never = model(x, loops=LOOPS, exit=ExitRule.parse(f"{criterion}:0"))
        always = model(x, loops=LOOPS, exit=ExitRule.parse(f"{criterion}:inf"))
        assert torch.equal(never.logits, model(x, loops=LOOPS).logits)
        assert torch.equal(always.logits, model(x, loops=1).logits)
    assert (never.exit_loops == LOOPS).all() and (always.exit_loops == 1).all()
    probing = CRITERIA[criterion].probes
    probes = never.exit_probes if probing else torch.zeros_like(never.exit_probes)
    assert (probes == (LOOPS + 1 if probing else 0)).all()


@pytest.mark.parametrize("scheme", ["mesh", "base", "anchor"])
def test_without_exit_the_loop_is_the_plain_computation_to_the_last_bit(scheme):
    """The do-nothing tracker hands every stage what it was given: the loop is the transcription."""
    model, x = model_for(scheme), x_batch()
    mask = torch.ones_like(x)
    mask[1, :4] = 0  # a left-padded row: the mask path too
    with torch.no_grad():
        run = model.enter(x, padding_mask=mask)
        h = run.h
        for t, core in enumerate(model.schedule(LOOPS)):
            h = model.scheme.update(t, h, model.cores[core](h, run.rope, run.mask), run.ctx)
        expected = model.head(model.coda(h, run.rope, run.mask))
        assert torch.equal(model(x, padding_mask=mask, loops=LOOPS).logits, expected)


def decode(model, prompts, new_tokens, rule, cache):
    """Greedy decoding of left-padded prompts, returning every step's last logits and exit loop
    counts."""
    from meshlm.generate import left_pad

    ids, mask = left_pad(prompts, pad_id=1)
    kv = KVCache() if cache else None
    step_input, logits, loops = ids, [], []
    with torch.no_grad():
        for _ in range(new_tokens):
            out = model(step_input, padding_mask=mask, cache=kv, loops=LOOPS, exit=rule)
            logits.append(out.logits[:, -1])
            loops.append(out.exit_loops[:, -1])
            token = out.logits[:, -1].argmax(-1)
            ids = torch.cat([ids, token[:, None]], 1)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
            step_input = token[:, None] if cache else ids
    return torch.stack(logits, 1), torch.stack(loops, 1)


@pytest.mark.parametrize("criterion", ["state", "kl"])
def test_cached_decoding_equals_uncached_with_exit_on_left_padded_batch(criterion):
    model = model_for()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]
    # kl values of this random model are ~1e-6, near fp32 rounding of the logits: a fixed τ clear of
    # the ties
    kl = CRITERIA[criterion] is ProbeKL
    threshold = 3e-6 if kl else mid_threshold(model, x_batch(), criterion)
    rule = ExitRule(criterion, threshold)
    cached, cached_loops = decode(model, prompts, 8, rule, cache=True)
    full, full_loops = decode(model, prompts, 8, rule, cache=False)
    assert torch.equal(cached_loops, full_loops)
    assert 1 < cached_loops.float().mean() < LOOPS  # tokens really exit at different steps
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("criterion,backbone", [("state", "neox"), ("kl", "neox"),
                                                ("state", "llama"), ("kl", "olmoe")])
def test_gathering_and_masking_compute_the_same_thing(criterion, backbone, monkeypatch):
    # llama and olmoe with grouped-query attention (2 key/value heads for 4 query heads)
    gqa = {} if backbone == "neox" else {"backbone": backbone, "n_kv_heads": 2, "n_experts": 4,
                                         "top_k": 2}
    model = build(tiny(spec="1+1R2+1", max_loops=LOOPS, **gqa))
    randomise_routers(model)
    x = x_batch(b=4, t=12)
    rule = ExitRule(criterion, mid_threshold(model, x, criterion))
    results, gathered = {}, []
    real_select = exit_module.ExitTracker.select

    def select(tracker):  # counts the steps that gathered
        real_select(tracker)
        gathered.append(tracker.sel is not None)

    monkeypatch.setattr(exit_module.ExitTracker, "select", select)
    for name, below in [("mask", 0.0), ("gather", 1.01)]:
        monkeypatch.setattr(exit_module, "GATHER_BELOW", below)
        gathered.clear()
        with torch.no_grad():
            results[name] = model(x, loops=LOOPS, exit=rule)
        assert any(gathered) == (name == "gather")  # the layout really ran
    assert torch.equal(results["mask"].exit_loops, results["gather"].exit_loops)
    assert 1 < results["mask"].exit_loops.float().mean() < LOOPS
    torch.testing.assert_close(results["mask"].logits, results["gather"].logits, rtol=1e-5,
                               atol=1e-5)


def test_gathered_tokens_lay_out_flat_and_per_row_alike():
    active = torch.tensor([[0, 1, 0, 1, 1], [0, 0, 0, 0, 0], [1, 0, 0, 1, 0]], dtype=torch.bool)
    g = Gathered.of(active)
    assert g.rows.tolist() == [0, 0, 0, 2, 2] and g.cols.tolist() == [1, 3, 4, 0, 3]
    assert g.flat.tolist() == [1, 3, 4, 10, 13]
    assert g.row_ids.tolist() == [0, 2]
    # per row, padded to the busiest (3): padding repeats the row's last token
    assert g.pad.tolist() == [[0, 1, 2], [3, 4, 4]]
    assert g.cols_padded.tolist() == [[1, 3, 4], [0, 3, 3]]
    assert g.unpad.tolist() == [0, 1, 2, 3, 4]  # the flat tokens' slots in the (2 x 3) layout
    x = torch.arange(15.0).view(3, 5, 1)
    assert g.take(x)[:, 0, 0].tolist() == [1.0, 3.0, 4.0, 10.0, 13.0]
    assert torch.equal(g.put(x.clone(), g.take(x)), x)


def test_an_exited_token_runs_no_further_core_passes():
    model = model_for()
    calls = []
    model.cores[0][0].register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[:2]))
    kv = KVCache()
    with torch.no_grad():
        model(x_batch(b=1, t=5), cache=kv, loops=LOOPS)
        calls.clear()
        model(torch.tensor([[3]]), cache=kv, loops=LOOPS, exit=ExitRule.parse("state:inf"))
    assert len(calls) == 1  # one core pass of LOOPS: the token exited after it
    # skipped steps' slots still got its K/V
    assert all(k is not None and k.shape[-2] == 6 for k in kv.keys)


@pytest.mark.parametrize("text, needle", [
    ("halt:0.1", "exit criterion 'halt' is unknown; use one of: state, kl"),
    ("state:-1", "exit threshold -1.0 must be a number >= 0"),
    ("state", "is not CRITERION:THRESHOLD"),
    ("kl:abc", "is not CRITERION:THRESHOLD"),
])
def test_bad_exit_rules_are_one_line_errors(text, needle):
    with pytest.raises(ConfigError, match=needle):
        ExitRule.parse(text)


def test_the_model_takes_the_rule_typed_never_as_text():
    """Text is parsed once where it comes in (CLI, HTTP body, YAML, the HF config), not per
    forward."""
    model = model_for("mesh")
    with pytest.raises(TypeError, match=r"pass an ExitRule .*ExitRule.parse\('state:0.1'\)"):
        model(x_batch(), loops=LOOPS, exit="state:0.1")


# -- a new criterion: one class and its registration, defined here without touching meshlm ----
class Entropy(Criterion):
    """The entropy of the next-token distribution of h^j: it probes, but compares with nothing."""

    probes = True

    def measure(self, seen):
        logp = torch.log_softmax(seen.logits.float(), -1)
        return (logp.exp() * -logp).sum(-1).clamp_min(0)


class Turn(Criterion):
    """1 − cos(h^j, h^{j−1}): how far the state turned, without probes."""

    def measure(self, seen):
        cos = torch.nn.functional.cosine_similarity(seen.after.float(), seen.before.float(), dim=-1)
        return (1 - cos).clamp_min(0)


@pytest.fixture(params=[Entropy, Turn], ids=["entropy", "turn"])
def new_criterion(request):
    """The criterion registered for one test (the registry is left as it was: other tests read its
    names)."""
    name = request.param.__name__.lower()
    register_criterion(name)(request.param)
    yield name
    del CRITERIA[name]


def test_a_new_criterion_runs_end_to_end(new_criterion):
    model, x = model_for(), x_batch()
    split = f"{new_criterion}:{mid_threshold(model, x, new_criterion)}"
    with torch.no_grad():
        never = model(x, loops=LOOPS, exit=ExitRule.parse(f"{new_criterion}:0"))
        always = model(x, loops=LOOPS, exit=ExitRule.parse(f"{new_criterion}:inf"))
        assert torch.equal(never.logits, model(x, loops=LOOPS).logits)
        assert torch.equal(always.logits, model(x, loops=1).logits)
        some = model(x, loops=LOOPS, exit=ExitRule.parse(split)).exit_loops.float().mean()
    assert (never.exit_loops == LOOPS).all() and (always.exit_loops == 1).all() and 1 < some < LOOPS
    assert (never.exit_probes == (LOOPS + 1 if CRITERIA[new_criterion].probes else 0)).all()
    with pytest.raises(ConfigError, match=f"use one of: state, kl, {new_criterion} "):
        ExitRule.parse("halt:0.1")


def test_a_new_criterion_decodes_cached_as_uncached(new_criterion):
    model = model_for()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]
    rule = ExitRule(new_criterion, mid_threshold(model, x_batch(), new_criterion))
    cached, cached_loops = decode(model, prompts, 8, rule, cache=True)
    full, full_loops = decode(model, prompts, 8, rule, cache=False)
    assert torch.equal(cached_loops, full_loops)
    assert 1 < cached_loops.float().mean() < LOOPS
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-5)
