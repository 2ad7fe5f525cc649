"""Every scheme and MeSH on every backbone: the model-core equivalences (causality, gradients, determinism,
cached vs. uncached decoding, base K=1 = vanilla, MeSH = its equations), the HF wrapper, config validation,
and retrofit from a Llama checkpoint. The neox backbone runs the same battery in test_schemes/test_kv_cache."""
import importlib
import sys

import pytest
import torch
from conftest import BF16_LOGITS, build, tiny
from test_kv_cache import decode_both_ways
from test_memory import randomise_routers, transcribed_mesh_logits

from meshlm.backbones import BACKBONES
from meshlm.config import PRESETS, ModelConfig
from meshlm.errors import ConfigError
from meshlm.model import SCHEMES, MeshLM
from meshlm.model.layers import Layer

OTHER = {"llama": dict(backbone="llama", n_kv_heads=2),
         "olmoe": dict(backbone="olmoe", n_kv_heads=2, n_experts=4, top_k=2, mlp_hidden=16)}
CASES = [(b, s) for b in OTHER for s in sorted(SCHEMES)]


def cfg_for(backbone: str, scheme: str = "mesh", **overrides) -> ModelConfig:
    spec = "1+2+1+1" if scheme == "vanilla" else "1+2R2+1"
    return tiny(spec=spec, scheme=scheme, **{**OTHER[backbone], **overrides})


def x_batch(cfg, b=2, t=12, seed=1):
    return torch.randint(0, cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


# -- the model-core battery, per backbone and scheme --------------------------------------------------------
@pytest.mark.parametrize("backbone, scheme", CASES)
def test_causal(backbone, scheme):
    model = build(cfg_for(backbone, scheme))
    x = x_batch(model.config, t=10)
    y = x.clone()
    y[:, 6:] = (y[:, 6:] + 1) % model.config.vocab_size
    torch.testing.assert_close(model(x).logits[:, :6], model(y).logits[:, :6], rtol=0, atol=0)
    assert not torch.allclose(model(x).logits[:, 6:], model(y).logits[:, 6:])


@pytest.mark.parametrize("backbone, scheme", CASES)
def test_gradients_reach_every_parameter(backbone, scheme):
    model = build(cfg_for(backbone, scheme)).train()
    x = x_batch(model.config)
    model(x, targets=torch.roll(x, -1, 1)).loss.backward()
    dead = [n for n, p in model.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert not dead, dead


@pytest.mark.parametrize("backbone, scheme", CASES)
def test_deterministic(backbone, scheme):
    cfg = cfg_for(backbone, scheme)
    a, b = build(cfg, seed=7), build(cfg, seed=7)
    x = x_batch(cfg)
    assert torch.equal(a(x).logits, b(x).logits)
    assert not torch.equal(a(x).logits, build(cfg, seed=8)(x).logits)  # the seed, not luck, made them equal


@pytest.mark.parametrize("backbone, scheme", CASES)
def test_cached_decoding_equals_uncached(backbone, scheme):
    model = build(cfg_for(backbone, scheme))
    worst, cache = decode_both_ways(model, steps=8)
    assert worst <= 1e-5, worst
    assert len(cache) == model.config.layout.unrolled_depth


@pytest.mark.parametrize("backbone", OTHER)
@pytest.mark.parametrize("loops", [1, 3])
def test_cached_decoding_with_other_loop_counts(backbone, loops):
    model = build(cfg_for(backbone))
    worst, cache = decode_both_ways(model, loops=loops, steps=4)
    assert worst <= 1e-5 and len(cache) == 2 + 2 * loops


@pytest.mark.parametrize("backbone", OTHER)
def test_base_with_one_loop_equals_vanilla_with_the_same_layers(backbone):
    vanilla = build(tiny(spec="4", scheme="vanilla", **OTHER[backbone]))
    base = build(tiny(spec="1+2R1+1", scheme="base", **OTHER[backbone]), seed=1)
    rename = {"cores.0.0.": "prelude.0.", "cores.0.1.": "cores.0.0.", "cores.0.2.": "cores.0.1.",
              "cores.0.3.": "coda.0."}
    state = {}
    for k, v in vanilla.state_dict().items():
        prefix = next((p for p in rename if k.startswith(p)), None)
        state[rename[prefix] + k[len(prefix):] if prefix else k] = v
    base.load_state_dict(state, strict=True)
    x = x_batch(vanilla.config)
    assert torch.equal(base(x).logits, vanilla(x).logits)


@pytest.mark.parametrize("backbone", OTHER)
@pytest.mark.parametrize("spec", ["1+1R2+1", "1+2R3+1", "2+1+1+1"])
def test_mesh_equals_the_transcribed_equations(backbone, spec):
    model = build(tiny(spec=spec, scheme="mesh", **OTHER[backbone]))
    randomise_routers(model)
    x = x_batch(model.config, t=11)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, transcribed_mesh_logits(model, x), rtol=0, atol=1e-5)


@pytest.mark.parametrize("backbone", OTHER)
def test_left_padding_with_positions_matches_unpadded(backbone):
    model = build(cfg_for(backbone))
    x = x_batch(model.config, b=1, t=7)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), x], 1)
    mask = torch.cat([torch.zeros(1, 3), torch.ones(1, 7)], 1).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(padded, padding_mask=mask, position_ids=positions)
    torch.testing.assert_close(out.logits[:, 3:], model(x).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("backbone", OTHER)
def test_bf16_autocast_runs_with_fp32_routers(backbone):
    model = build(cfg_for(backbone))
    x = x_batch(model.config, t=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, targets=x, return_states=True)
    assert all(r.dtype == torch.float32 for r in out.stages.router_logits)
    assert torch.isfinite(out.loss)
    torch.testing.assert_close(out.logits.float(), model(x).logits, **BF16_LOGITS)


def test_tied_embeddings_share_one_table():
    model = build(cfg_for("llama", tie_embeddings=True))
    assert model.embed_out is None and "embed_out.weight" not in model.state_dict()
    x = x_batch(model.config)
    model(x, targets=x).loss.backward()
    assert model.embed_in.weight.grad.abs().sum() > 0


def test_every_backbone_has_its_own_layer_class_and_norm():
    assert len({b.layer for b in BACKBONES.values()}) == len(BACKBONES)
    for name, backbone in BACKBONES.items():
        assert issubclass(backbone.layer, Layer)
        model = MeshLM(ModelConfig.from_preset("tiny", backbone=name))
        layers = [m for m in model.modules() if isinstance(m, Layer)]
        assert len(layers) == model.config.layout.unique_depth
        assert all(type(m) is backbone.layer for m in layers)
        assert type(model.final_layer_norm) is type(layers[0].input_layernorm)


def test_no_module_outside_the_registry_branches_on_a_backbone_name():
    import ast
    from pathlib import Path

    import meshlm

    package = Path(meshlm.__file__).parent
    branches = [f"{path.relative_to(package)}:{node.lineno}" for path in package.rglob("*.py")
                if path.name != "backbones.py" or path.parent != package
                for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Compare)
                for side in [node.left, *node.comparators]
                if isinstance(side, ast.Constant) and side.value in BACKBONES]
    assert branches == []


def test_the_registry_drives_what_names_backbones():
    from meshlm.cli import build_parser
    from meshlm.hf.modeling import MeshForCausalLM

    assert MeshForCausalLM._no_split_modules == [b.layer.__name__ for b in BACKBONES.values()]
    to = next(a for a in build_parser()._subparsers._group_actions[0].choices["convert"]._actions if a.dest == "to")
    assert to.choices == ("meshlm", "hf", *BACKBONES)
    assert [name for name, b in BACKBONES.items() if b.moe] == ["olmoe"]


# -- the Hugging Face wrapper -------------------------------------------------------------------------------
@pytest.mark.parametrize("backbone, extra", [("llama", {}), ("llama", {"tie_embeddings": True}), ("olmoe", {})])
def test_hf_save_load_round_trip(backbone, extra, tmp_path):
    from transformers import AutoModelForCausalLM

    from meshlm.hf import save_hf

    model = build(cfg_for(backbone, vocab_size=8192, **extra))
    save_hf(model, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = torch.randint(0, 8192, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    out = loaded.generate(x[:, :4], max_new_tokens=3, do_sample=False)
    assert out.shape == (2, 7)


def test_generated_code_runs_as_its_own_package_with_moe(tmp_path):
    from meshlm.hf import save_hf

    model = build(cfg_for("olmoe", vocab_size=8192))
    save_hf(model, tmp_path / "pkg_meshlm_olmoe")
    (tmp_path / "pkg_meshlm_olmoe" / "__init__.py").write_text("")
    sys.path.insert(0, str(tmp_path))
    try:
        remote = importlib.import_module("pkg_meshlm_olmoe.modeling_meshlm")
    finally:
        sys.path.remove(str(tmp_path))
    loaded = remote.MeshForCausalLM.from_pretrained(tmp_path / "pkg_meshlm_olmoe").eval()
    x = torch.randint(0, 8192, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


# -- config ---------------------------------------------------------------------------------------------------
def test_backbone_problems_are_named_in_one_message():
    with pytest.raises(ConfigError) as info:
        ModelConfig(backbone="olmoe", n_heads=8, n_kv_heads=3, n_experts=4, top_k=5, aux_loss_weight=-1,
                    tie_embeddings="yes", mlp_hidden=0)
    message = str(info.value)
    for needle in ["n_kv_heads=3 must be a positive divisor of n_heads=8", "top_k=5 must be an integer in [1, "
                   "n_experts=4]", "aux_loss_weight=-1", "tie_embeddings='yes'", "mlp_hidden=0"]:
        assert needle in message, needle
    with pytest.raises(ConfigError, match="backbone='gpt2' is unknown; choose one of: neox, llama, olmoe"):
        ModelConfig(backbone="gpt2")
    with pytest.raises(ConfigError, match="neox backbone has no grouped-query attention.*neox backbone has no QK-norm"):
        ModelConfig(n_kv_heads=2, qk_norm=True)


def test_backbone_defaults():
    neox, llama, olmoe = (ModelConfig(d_model=256, n_heads=8, backbone=b) for b in ("neox", "llama", "olmoe"))
    assert (neox.rotary_dims, llama.rotary_dims, olmoe.rotary_dims) == (8, 32, 32)
    assert (neox.mlp_width, llama.mlp_width, olmoe.mlp_width) == (1024, 704, 128)
    assert (neox.uses_qk_norm, llama.uses_qk_norm, olmoe.uses_qk_norm) == (False, False, True)
    assert llama.kv_heads == 8 and ModelConfig.from_dict(llama.to_dict()) == llama
    # a config changed to another backbone takes that backbone's defaults (the fields stay null)
    assert ModelConfig.from_preset("tiny", backbone="llama").rotary_dims == 16


def test_backbone_presets():
    for name in ["tiny-llama", "tiny-olmoe", "llama-small", "llama-mesh-small", "olmoe-small", "olmoe-1b-7b",
                 "olmoe-2.6b-a512m", "olmoe-2.6b-a512m-4+8R2+4"]:
        assert name in PRESETS
        ModelConfig.from_preset(name)


# -- retrofit from a Llama checkpoint ------------------------------------------------------------------------
def test_retrofit_with_one_pass_reproduces_the_llama_source(llama_folder):
    from meshlm.interop.retrofit import retrofit
    from meshlm.loading import read_family

    folder, hf = llama_folder
    cfg, state = read_family(folder)
    model, _ = retrofit(cfg, state, "1+2R1+1", scheme="base", core_init="block")
    x = torch.randint(0, 8192, (2, 13))
    with torch.no_grad():
        assert (model(x).logits - hf(x).logits).abs().max() <= 1e-5


def test_retrofit_llama_to_mesh_starts_as_plain_recursion(llama_folder, tmp_path):
    """Continued training of the retrofit with `meshlm train` is in test_init_from."""
    from meshlm.cli import main
    from meshlm.loading import open_model

    folder, _ = llama_folder
    assert main(["retrofit", str(folder), str(tmp_path / "mesh"), "--spec", "1+1R2+1", "--core-init", "block"]) == 0
    assert main(["retrofit", str(folder), str(tmp_path / "base"), "--spec", "1+1R2+1", "--core-init", "block",
                 "--scheme", "base"]) == 0
    mesh, base = open_model(tmp_path / "mesh").model, open_model(tmp_path / "base").model
    assert (mesh.config.backbone, mesh.config.scheme, mesh.config.scale_embeddings) == ("llama", "mesh", False)
    x = torch.randint(0, 8192, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # base-started routers: MeSH begins (almost) where the looped source is
        gap = (mesh(x).logits.softmax(-1) - base(x).logits.softmax(-1)).abs().sum(-1).max()
    assert gap < 0.1, gap
