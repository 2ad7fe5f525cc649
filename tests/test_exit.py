"""Per-token adaptive exit: τ = 0 is full depth, τ = ∞ is one loop, cached == uncached, compute is skipped."""
import pytest
import torch
from conftest import build, tiny
from test_memory import randomise_routers

from meshlm.errors import ConfigError
from meshlm.model import exit as exit_module
from meshlm.model.exit import ExitRule
from meshlm.model.kv_cache import KVCache

LOOPS = 4


def model_for(scheme="mesh"):
    model = build(tiny(spec="1+1R2+1", scheme=scheme, max_loops=LOOPS))
    if scheme == "mesh":
        randomise_routers(model)  # far from uniform: tokens converge at different steps
    return model


def x_batch(b=3, t=10, seed=0):
    return torch.randint(0, 97, (b, t), generator=torch.Generator().manual_seed(seed))


def mid_threshold(model, x, criterion, step=1):
    """A τ that splits the tokens at `step` and sits far from every token's value (no float-rounding ties)."""
    with torch.no_grad():
        states = model(x, loops=LOOPS, return_states=True).stages.states
        if criterion == "state":
            values = ((states[step + 1] - states[step]).norm(dim=-1) / states[step].norm(dim=-1)).flatten()
        else:
            logp = [torch.log_softmax(model.head(model.coda(s, model.rotary(torch.arange(x.shape[1])[None],
                                                                            s.dtype), None)), -1) for s in states]
            values = (logp[step + 1].exp() * (logp[step + 1] - logp[step])).sum(-1).flatten()
    v = values.sort().values
    gaps = v[1:] - v[:-1]
    middle = len(v) // 2
    i = middle - 3 + int(gaps[middle - 3:middle + 3].argmax())  # the widest gap near the median
    return ((v[i] + v[i + 1]) / 2).item()


@pytest.mark.parametrize("scheme", ["mesh", "base", "anchor"])
@pytest.mark.parametrize("criterion", ["state", "kl"])
def test_threshold_zero_is_full_depth_and_infinity_is_one_loop(scheme, criterion):
    model, x = model_for(scheme), x_batch()
    with torch.no_grad():
        never = model(x, loops=LOOPS, exit=f"{criterion}:0")
        always = model(x, loops=LOOPS, exit=f"{criterion}:inf")
        assert torch.equal(never.logits, model(x, loops=LOOPS).logits)
        assert torch.equal(always.logits, model(x, loops=1).logits)
    assert (never.exit_loops == LOOPS).all() and (always.exit_loops == 1).all()
    probes = never.exit_probes if criterion == "kl" else torch.zeros_like(never.exit_probes)
    assert (probes == (LOOPS + 1 if criterion == "kl" else 0)).all()


def decode(model, prompts, new_tokens, rule, cache):
    """Greedy decoding of left-padded prompts, returning every step's last logits and exit loop counts."""
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
    # kl values of this random model are ~1e-6, near fp32 rounding of the logits: a fixed τ clear of the ties
    rule = ExitRule(criterion, mid_threshold(model, x_batch(), criterion) if criterion == "state" else 3e-6)
    cached, cached_loops = decode(model, prompts, 8, rule, cache=True)
    full, full_loops = decode(model, prompts, 8, rule, cache=False)
    assert torch.equal(cached_loops, full_loops)
    assert 1 < cached_loops.float().mean() < LOOPS  # tokens really exit at different steps
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("criterion", ["state", "kl"])
def test_gathering_and_masking_compute_the_same_thing(criterion, monkeypatch):
    model, x = model_for(), x_batch(b=4, t=12)
    rule = ExitRule(criterion, mid_threshold(model, x, criterion))
    results = {}
    for name, below in [("mask", 0.0), ("gather", 1.01)]:
        monkeypatch.setattr(exit_module, "GATHER_BELOW", below)
        with torch.no_grad():
            results[name] = model(x, loops=LOOPS, exit=rule)
    assert torch.equal(results["mask"].exit_loops, results["gather"].exit_loops)
    assert 1 < results["mask"].exit_loops.float().mean() < LOOPS
    torch.testing.assert_close(results["mask"].logits, results["gather"].logits, rtol=1e-5, atol=1e-5)


def test_an_exited_token_runs_no_further_core_passes():
    model = model_for()
    calls = []
    model.cores[0][0].register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[:2]))
    kv = KVCache()
    with torch.no_grad():
        model(x_batch(b=1, t=5), cache=kv, loops=LOOPS)
        calls.clear()
        model(torch.tensor([[3]]), cache=kv, loops=LOOPS, exit="state:inf")
    assert len(calls) == 1  # one core pass of LOOPS: the token exited after it
    assert all(k is not None and k.shape[-2] == 6 for k in kv.keys)  # skipped steps' slots still got its K/V


@pytest.mark.parametrize("text, needle", [
    ("halt:0.1", "exit criterion 'halt' is unknown; use one of: state, kl"),
    ("state:-1", "exit threshold -1.0 must be a number >= 0"),
    ("state", "is not CRITERION:THRESHOLD"),
    ("kl:abc", "is not CRITERION:THRESHOLD"),
])
def test_bad_exit_rules_are_one_line_errors(text, needle):
    with pytest.raises(ConfigError, match=needle):
        ExitRule.parse(text)
