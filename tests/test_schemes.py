"""Every registered scheme through the one loop: its formula, equivalences between schemes, states
and shapes. What every backbone × scheme must do is in the model battery (test_model_battery.py)."""
import pytest
import torch
from conftest import build, copy_layers, tiny

from meshlm.config import SCHEME_OPTIONS, ModelConfig
from meshlm.errors import ConfigError
from meshlm.model import SCHEMES
from meshlm.model.schemes import LoopContext, build_scheme, register

ALL = sorted(SCHEMES)


def test_every_declared_scheme_has_a_class_and_every_class_a_declaration():
    assert set(SCHEMES) == set(SCHEME_OPTIONS)
    for name in SCHEMES:
        defaults = SCHEME_OPTIONS[name].defaults
        assert build_scheme(tiny(spec=spec_for(name), scheme=name)).options == defaults


def test_registering_an_undeclared_scheme_says_where_to_declare_it():
    with pytest.raises(ValueError, match="SCHEME_OPTIONS"):
        register("not-declared")


def test_config_checks_scheme_options_without_the_model():
    with pytest.raises(ConfigError, match=r"scheme_options.slots=1 must be an integer >= 2 "
                                          r"\(default K\+3 = 5\)"):
        ModelConfig(spec="1+2R2+1", scheme="mesh", scheme_options={"slots": 1})
    with pytest.raises(ConfigError,
                       match=r"\['slots'\] are not options of scheme 'anchor-emb' \(valid: none\)"):
        ModelConfig(scheme="anchor*", scheme_options={"slots": 4})


def spec_for(scheme: str) -> str:
    return "1+2+1+1" if scheme == "vanilla" else "1+1R2+1"


def x_batch(cfg, b=2, t=12, seed=1):
    return torch.randint(0, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


# -- equivalences ----------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["base", "residual", "anchor", "anchor-emb", "residual+anchor",
                                    "residual+anchor+anchor-emb", "anchor+anchor-emb"])
def test_fixed_scheme_formula(scheme):
    """h^{t+1} = u + Σ terms, with the named terms exactly."""
    cfg = tiny(scheme=scheme)
    s = build_scheme(cfg)
    e, p, h, u = torch.randn(4, 2, 3, cfg.d_model).unbind(0)
    ctx = LoopContext(e=e)
    assert s.begin(ctx, p) is p
    expected = u + (h if "residual" in scheme
                    else 0) + (p if "anchor" in scheme.replace("anchor-emb", "") else 0) \
        + (e if "anchor-emb" in scheme else 0)
    torch.testing.assert_close(s.update(0, h, u, ctx), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("scheme, zeroed, below", [
    ("residual", "h", "base"),
    ("anchor", "h0", "base"),
    ("anchor-emb", "e", "base"),
    ("residual+anchor", "h0", "residual"),
    ("residual+anchor", "h", "anchor"),
    ("residual+anchor+anchor-emb", "e", "residual+anchor"),
    ("anchor+anchor-emb", "e", "anchor"),
    ("anchor+anchor-emb", "h0", "anchor-emb"),
])
def test_each_fixed_scheme_reduces_to_the_one_below_when_its_extra_term_is_zeroed(scheme, zeroed,
                                                                                  below):
    cfg = tiny(scheme=scheme)
    upper, lower = build_scheme(cfg), build_scheme(tiny(scheme=below))
    terms = dict(zip(["e", "h0", "h", "u"], torch.randn(4, 2, 3, cfg.d_model).unbind(0)))
    terms[zeroed] = torch.zeros_like(terms[zeroed])
    ctx = LoopContext(e=terms["e"], h0=terms["h0"])
    assert torch.equal(upper.update(0, terms["h"], terms["u"], ctx),
                       lower.update(0, terms["h"], terms["u"], ctx))


@pytest.mark.parametrize("alpha, fixed", [
    ([1.0, 0.0, 0.0], "base"), ([1.0, 1.0, 0.0], "anchor"), ([1.0, 0.0, 1.0], "anchor-emb"),
    ([1.0, 1.0, 1.0], "anchor+anchor-emb"),
])
def test_static_mix_with_fixed_alphas_equals_the_fixed_scheme(alpha, fixed):
    mix = build(tiny(scheme="static-mix", scheme_options={"alpha_init": alpha}))
    ref = build(tiny(scheme=fixed), seed=3)
    copy_layers(mix, ref)
    x = x_batch(mix.config)
    torch.testing.assert_close(mix(x).logits, ref(x).logits, rtol=0, atol=1e-5)


def test_dynamic_mix_with_zero_weights_equals_static_mix():
    dyn = build(tiny(scheme="dynamic-mix", scheme_options={"alpha_init": [0.7, 1.2, 0.3]}))
    with torch.no_grad():
        dyn.scheme.alpha.proj.weight.zero_()
    static = build(tiny(scheme="static-mix", scheme_options={"alpha_init": [0.7, 1.2, 0.3]}),
                   seed=5)
    copy_layers(dyn, static)
    x = x_batch(dyn.config)
    torch.testing.assert_close(dyn(x).logits, static(x).logits, rtol=0, atol=1e-5)


def test_anchor_star_alias_builds_anchor_to_embeddings():
    a, b = build(tiny(scheme="anchor*")), build(tiny(scheme="anchor-emb"))
    x = x_batch(a.config)
    assert torch.equal(a(x).logits, b(x).logits)


# -- properties of every registered scheme (backbone × scheme: test_model_battery.py) -----------
@pytest.mark.parametrize("scheme", ALL)
def test_returned_states_have_the_right_shapes(scheme):
    cfg = tiny(scheme=scheme, spec=spec_for(scheme))
    model = build(cfg)
    x = x_batch(cfg, b=3, t=9)
    out = model(x, return_states=True)
    steps = cfg.layout.n_steps
    shape = (3, 9, cfg.d_model)
    st = out.stages
    assert out.logits.shape == (3, 9, cfg.vocab_size) and out.loss is None
    assert st.embeddings.shape == st.prelude.shape == st.coda.shape == shape
    assert len(st.states) == steps + 1 and all(h.shape == shape for h in st.states)
    assert len(st.core_outputs) == steps and all(u.shape == shape for u in st.core_outputs)
    if scheme == "mesh":
        assert len(st.routing) == steps + 1
        for w, r in st.routing:
            assert w.shape == r.shape == (3, 9, model.scheme.slots)
            torch.testing.assert_close(w.sum(-1), torch.ones(3, 9))
    else:
        assert st.routing == []
        if scheme in ("base", "vanilla"):  # no state mixing: h^{t+1} is the core output itself
            assert all(torch.equal(h, u) for h, u in zip(st.states[1:], st.core_outputs))
    assert model(x).stages is None


@pytest.mark.parametrize("scheme", ALL)
def test_loss_is_next_token_cross_entropy(scheme):
    model = build(tiny(scheme=scheme, spec=spec_for(scheme)))
    x = x_batch(model.config)
    targets = torch.roll(x, -1, 1)
    targets[:, -1] = -100
    out = model(x, targets=targets)
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1),
                                                 targets[:, :-1].flatten())
    torch.testing.assert_close(out.loss, expected)


def test_sequence_longer_than_context_is_a_clear_error():
    from meshlm.errors import ConfigError

    model = build(tiny(context_length=8))
    with pytest.raises(ConfigError, match="exceeds the model's context_length=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_model_module_never_touches_files_or_logging():
    import pathlib

    import meshlm.model as pkg

    for path in pathlib.Path(pkg.__file__).parent.glob("*.py"):
        text = path.read_text()
        for forbidden in ["import logging", "open(", "torch.distributed", "print("]:
            assert forbidden not in text, f"{path.name} uses {forbidden}"


@pytest.mark.parametrize("scheme", [s for s in ALL if s != "vanilla"])
def test_every_scheme_runs_at_one_to_four_times_its_depth(scheme):
    """Elastic depth: K' = 1 … 4K loops (max_loops = 4K gives MeSH a router pair per step)."""
    model = build(tiny(spec="1+1R2+1", scheme=scheme, max_loops=8))
    x = x_batch(model.config, t=6)
    for loops in range(1, 9):
        out = model(x, targets=x, loops=loops, return_states=True)
        assert len(out.stages.states) == loops + 1 and torch.isfinite(out.loss)
    out.loss.backward()
