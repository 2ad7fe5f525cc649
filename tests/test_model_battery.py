"""The shared model battery: every registered backbone × every registered scheme through the same
checks (transformers' shared model tester is the model): causality, gradients reach every
parameter, determinism, cached vs. uncached decoding, base K=1 = vanilla, left padding, bf16
autocast. The cases come from the registries, so a new backbone or scheme is tested by registering
it; the checks are plain functions, so a backbone defined in a test runs them too
(tests/test_backbones.py). Scheme-only facts are in test_schemes.py, backbone-only ones in
test_backbones.py."""
import pytest
import torch
from conftest import BF16_LOGITS, build, tiny
from test_kv_cache import PROMPT_LENGTHS, decode_both_ways

from meshlm.backbones import BACKBONES
from meshlm.config import ModelConfig
from meshlm.model import SCHEMES

# fields beyond tiny()'s that exercise what a backbone has (grouped-query heads, experts); a
# backbone not named here runs with its defaults
FIELDS = {"llama": dict(n_kv_heads=2),
          "olmoe": dict(n_kv_heads=2, n_experts=4, top_k=2, mlp_hidden=16)}
CASES = [(b, s) for b in BACKBONES for s in sorted(SCHEMES)]
DECODE_STEPS = 20


def fields_of(backbone: str) -> dict:
    return {"backbone": backbone, **FIELDS.get(backbone, {})}


def cfg_for(backbone: str, scheme: str = "mesh", **overrides) -> ModelConfig:
    """A tiny model of `backbone` and `scheme`; the core has 2 layers, so cache slots differ within
    a pass too."""
    spec = "1+2+1+1" if scheme == "vanilla" else "1+2R2+1"
    return tiny(spec=spec, scheme=scheme, **fields_of(backbone), **overrides)


def x_batch(cfg, b=2, t=12, seed=1):
    return torch.randint(0, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


# -- the checks ------------------------------------------------------------------------------------
def check_causal(cfg: ModelConfig) -> None:
    model = build(cfg)
    x = x_batch(cfg, t=10)
    y = x.clone()
    y[:, 6:] = (y[:, 6:] + 1) % cfg.vocab_size  # change tokens 6 … 9
    with torch.no_grad():
        a, b = model(x).logits, model(y).logits
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=0)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def check_gradients_reach_every_parameter(cfg: ModelConfig) -> None:
    model = build(cfg).train()
    x = x_batch(cfg)
    model(x, targets=torch.roll(x, -1, 1)).loss.backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not dead, dead


def check_deterministic(cfg: ModelConfig) -> None:
    x = x_batch(cfg)
    with torch.no_grad():
        first, again, other = (build(cfg, seed=s)(x).logits for s in (7, 7, 8))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)  # the seed, not luck, made them equal


def check_cached_decoding(cfg: ModelConfig, loops: int | None = None,
                          steps: int = DECODE_STEPS) -> None:
    """Cached == uncached over a left-padded batch, with one cache slot per unrolled layer."""
    model = build(cfg)
    worst, cache = decode_both_ways(model, loops=loops, steps=steps)
    assert worst <= 1e-5, worst
    layout = cfg.layout  # a loops override runs the one core `loops` times
    slots = (layout.prelude + loops * layout.cores[0] + layout.coda if loops
             else layout.unrolled_depth)
    assert len(cache) == slots
    assert cache.get_seq_length() == max(PROMPT_LENGTHS) + steps


# -- every backbone × every scheme -----------------------------------------------------------------
CHECKS = {"causal": check_causal, "gradients": check_gradients_reach_every_parameter,
          "deterministic": check_deterministic, "cached-decoding": check_cached_decoding}


@pytest.mark.parametrize("backbone, scheme", CASES)
@pytest.mark.parametrize("check", CHECKS)
def test_every_backbone_and_scheme(check, backbone, scheme):
    CHECKS[check](cfg_for(backbone, scheme))


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("scheme", ["mesh", "base", "residual+anchor", "dynamic-mix"])
@pytest.mark.parametrize("loops", [1, 3])
def test_cached_decoding_with_other_loop_counts(backbone, scheme, loops):
    """Extrapolating (or shrinking) the loop at inference: the cache grows a slot per unrolled
    layer."""
    check_cached_decoding(cfg_for(backbone, scheme), loops=loops, steps=6)


# -- every backbone --------------------------------------------------------------------------------
@pytest.mark.parametrize("backbone", BACKBONES)
def test_base_with_one_loop_equals_vanilla_with_the_same_layers(backbone):
    vanilla = build(tiny(spec="4", scheme="vanilla", **fields_of(backbone)))
    base = build(tiny(spec="1+2R1+1", scheme="base", **fields_of(backbone)), seed=1)
    # vanilla keeps all 4 layers in one core; base splits them 1 / 2 / 1
    rename = {"cores.0.0.": "prelude.0.", "cores.0.1.": "cores.0.0.", "cores.0.2.": "cores.0.1.",
              "cores.0.3.": "coda.0."}
    state = {}
    for k, v in vanilla.state_dict().items():
        prefix = next((p for p in rename if k.startswith(p)), None)
        state[rename[prefix] + k[len(prefix):] if prefix else k] = v
    base.load_state_dict(state, strict=True)
    x = x_batch(vanilla.config)
    assert torch.equal(base(x).logits, vanilla(x).logits)


@pytest.mark.parametrize("backbone", BACKBONES)
@pytest.mark.parametrize("scheme", ["mesh", "base", "dynamic-mix"])
def test_left_padding_with_positions_matches_unpadded(backbone, scheme):
    model = build(cfg_for(backbone, scheme))
    x = x_batch(model.config, b=1, t=7)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), x], 1)
    mask = torch.cat([torch.zeros(1, 3), torch.ones(1, 7)], 1).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(padded, padding_mask=mask, position_ids=positions).logits[:, 3:]
    torch.testing.assert_close(out, model(x).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("backbone", BACKBONES)
def test_bf16_autocast_runs_with_fp32_routers(backbone):
    """The GPU path (bf16 autocast) on a tiny CPU tensor: MeSH and MoE routers stay fp32, the loss
    is finite, the logits stay close."""
    model = build(cfg_for(backbone))
    x = x_batch(model.config, t=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, targets=x, return_states=True)
    assert all(w.dtype == r.dtype == torch.float32 for w, r in out.stages.routing)
    assert len(out.stages.routing) == model.config.layout.n_steps + 1
    assert all(r.dtype == torch.float32 for r in out.stages.router_logits)
    assert (len(out.stages.router_logits) > 0) == BACKBONES[backbone].moe
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)
    torch.testing.assert_close(out.logits.float(), model(x).logits, **BF16_LOGITS)
