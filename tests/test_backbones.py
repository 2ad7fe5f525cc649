"""What is a backbone's own: MeSH on each, its layer class and norm, the registry as the one place
that names backbones (a backbone defined here runs the model battery by registering it), the HF
wrapper, config validation, and retrofit from a Llama checkpoint. What every backbone × scheme
must do (causality, gradients, determinism, cached decoding, base K=1 = vanilla, left padding,
bf16) is the model battery, tests/test_model_battery.py."""
import importlib
import sys

import pytest
import test_model_battery as battery
import torch
from conftest import build, tiny
from test_memory import randomise_routers, transcribed_mesh_logits
from test_model_battery import FIELDS, cfg_for, x_batch

from meshlm.backbones import BACKBONES, Backbone, layer_of, register_backbone
from meshlm.config import PRESETS, ModelConfig
from meshlm.errors import ConfigError
from meshlm.model import MeshLM, attach_layers
from meshlm.model.layers import Layer

OTHER = {name: {"backbone": name, **fields} for name, fields in FIELDS.items()}


# -- MeSH on the other backbones (neox: test_memory.py) -------------------------------------------
@pytest.mark.parametrize("backbone", OTHER)
@pytest.mark.parametrize("spec", ["1+1R2+1", "1+2R3+1", "2+1+1+1"])
def test_mesh_equals_the_transcribed_equations(backbone, spec):
    model = build(tiny(spec=spec, scheme="mesh", **OTHER[backbone]))
    randomise_routers(model)
    x = x_batch(model.config, t=11)
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, transcribed_mesh_logits(model, x), rtol=0,
                                   atol=1e-5)


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


# -- a new backbone: its layer file and its registration, nothing in meshlm touched --------------
LAYER_FILE = '''"""A backbone of one's own: GPT-NeoX's attention and MLP, sequential residual."""
from torch import nn

from meshlm.backbones import layer_of
from meshlm.model.layers import Layer, NeoXAttention, NeoXMLP


@layer_of("serial-neox")
class SerialNeoXLayer(Layer):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = self.norm(cfg), self.norm(cfg)
        self.attention, self.mlp = NeoXAttention(cfg), NeoXMLP(cfg)

    @staticmethod
    def norm(cfg):
        return nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)

    def forward(self, x, rope, mask, cache=None, slot=0, router_logits=None):
        x = x + self.attention(self.input_layernorm(x), rope, mask, cache, slot)
        return x + self.mlp(self.post_attention_layernorm(x))
'''


@pytest.fixture
def serial_neox(tmp_path, monkeypatch):
    """The backbone registered for one test (the registry is left as it was: others list it)."""
    (tmp_path / "serial_neox.py").write_text(LAYER_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))

    class SerialNeoX(Backbone):
        name, title, layer_module = "serial-neox", "GPT-NeoX, sequential residual", "serial_neox"
        rotary_fraction = 0.25
        grouped_query = qk_norm_possible = False

    register_backbone(SerialNeoX)
    try:
        attach_layers()  # what importing meshlm.model does: the registry names the module
        yield SerialNeoX.name
    finally:
        del BACKBONES[SerialNeoX.name]
        sys.modules.pop("serial_neox", None)


def test_a_backbone_registered_outside_meshlm_runs_the_battery(serial_neox):
    layer = BACKBONES[serial_neox].layer
    assert layer.__module__ == "serial_neox" and issubclass(layer, Layer)
    for scheme in ("mesh", "vanilla"):
        cfg = cfg_for(serial_neox, scheme)
        for check in battery.CHECKS.values():
            check(cfg)
    model = build(cfg_for(serial_neox))
    assert all(type(m) is layer for m in model.modules() if isinstance(m, Layer))
    assert type(model.final_layer_norm) is torch.nn.LayerNorm
    assert cfg_for(serial_neox).rotary_dims == 2  # its default: 25% of each head's 8 dims
    with pytest.raises(ConfigError, match="choose one of: neox, llama, olmoe, serial-neox"):
        ModelConfig(backbone="gpt2")


def test_a_layer_module_that_attaches_no_layer_is_named(monkeypatch):
    class Forgotten(Backbone):
        name, layer_module = "forgotten", "meshlm.errors"  # a module with no @layer_of

    monkeypatch.setitem(BACKBONES, "forgotten", Forgotten())
    with pytest.raises(ValueError, match=r"'forgotten'.*'meshlm.errors' attaches no layer; "
                                         r"decorate its layer class with @layer_of\('forgotten'\)"):
        attach_layers()
    with pytest.raises(ValueError, match="no backbone 'nameless' is registered"):
        layer_of("nameless")


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
    to = next(a for a in build_parser()._subparsers._group_actions[0].choices["convert"]._actions
              if a.dest == "to")
    assert to.choices == ("meshlm", "hf", *BACKBONES)
    assert [name for name, b in BACKBONES.items() if b.moe] == ["olmoe"]


# -- the Hugging Face wrapper ----------------------------------------------------------------------
@pytest.mark.parametrize("backbone, extra",
                         [("llama", {}), ("llama", {"tie_embeddings": True}), ("olmoe", {})])
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


# -- config ----------------------------------------------------------------------------------------
def test_backbone_problems_are_named_in_one_message():
    with pytest.raises(ConfigError) as info:
        ModelConfig(backbone="olmoe", n_heads=8, n_kv_heads=3, n_experts=4, top_k=5,
                    aux_loss_weight=-1,
                    tie_embeddings="yes", mlp_hidden=0)
    message = str(info.value)
    for needle in ["n_kv_heads=3 must be a positive divisor of n_heads=8",
                   "top_k=5 must be an integer in [1, "
                   "n_experts=4]", "aux_loss_weight=-1", "tie_embeddings='yes'", "mlp_hidden=0"]:
        assert needle in message, needle
    with pytest.raises(ConfigError,
                       match="backbone='gpt2' is unknown; choose one of: neox, llama, olmoe"):
        ModelConfig(backbone="gpt2")
    with pytest.raises(ConfigError, match="neox backbone has no grouped-query attention.*neox "
                                          "backbone has no QK-norm"):
        ModelConfig(n_kv_heads=2, qk_norm=True)


def test_backbone_defaults():
    neox, llama, olmoe = (ModelConfig(d_model=256, n_heads=8, backbone=b)
                          for b in ("neox", "llama", "olmoe"))
    assert (neox.rotary_dims, llama.rotary_dims, olmoe.rotary_dims) == (8, 32, 32)
    assert (neox.mlp_width, llama.mlp_width, olmoe.mlp_width) == (1024, 704, 128)
    assert (neox.uses_qk_norm, llama.uses_qk_norm, olmoe.uses_qk_norm) == (False, False, True)
    assert llama.kv_heads == 8 and ModelConfig.from_dict(llama.to_dict()) == llama
    # a config changed to another backbone takes that backbone's defaults (the fields stay null)
    assert ModelConfig.from_preset("tiny", backbone="llama").rotary_dims == 16


def test_backbone_presets():
    for name in ["tiny-llama", "tiny-olmoe", "llama-small", "llama-mesh-small", "olmoe-small",
                 "olmoe-1b-7b",
                 "olmoe-2.6b-a512m", "olmoe-2.6b-a512m-4+8R2+4"]:
        assert name in PRESETS
        ModelConfig.from_preset(name)


# -- retrofit from a Llama checkpoint --------------------------------------------------------------
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
    assert (main(["retrofit", str(folder), str(tmp_path / "mesh"), "--spec", "1+1R2+1",
                  "--core-init", "block"]) == 0)
    assert (main(["retrofit", str(folder), str(tmp_path / "base"), "--spec", "1+1R2+1",
                  "--core-init", "block",
                  "--scheme", "base"]) == 0)
    mesh, base = open_model(tmp_path / "mesh").model, open_model(tmp_path / "base").model
    assert (mesh.config.backbone, mesh.config.scheme,
            mesh.config.scale_embeddings) == ("llama", "mesh", False)
    x = torch.randint(0, 8192, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # base-started routers: MeSH begins (almost) where the looped source is
        gap = (mesh(x).logits.softmax(-1) - base(x).logits.softmax(-1)).abs().sum(-1).max()
    assert gap < 0.1, gap
