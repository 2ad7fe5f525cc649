"""meshlm's llama backbone is Llama: same logits as transformers' LlamaForCausalLM with copied
weights, and exact conversion both ways (state dicts and Hugging Face folders)."""
import pytest
import torch
from transformers import LlamaForCausalLM

from meshlm.backbones import BACKBONES
from meshlm.config import ModelConfig
from meshlm.interop.convert import convert
from meshlm.interop.families import from_meshlm, hf_config, to_meshlm
from meshlm.loading import read_family
from meshlm.model import MeshLM

LLAMA = BACKBONES["llama"]


def llama_cfg(**overrides) -> ModelConfig:
    base = dict(spec="3", d_model=64, n_heads=4, n_kv_heads=2, vocab_size=211, context_length=64,
                mlp_hidden=96,
                rotary_base=500.0, layer_norm_eps=1e-6, backbone="llama", scheme="vanilla",
                scale_embeddings=False)
    return ModelConfig(**{**base, **overrides})


def llama_pair(cfg: ModelConfig):
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_config(cfg, LLAMA, tied=cfg.tie_embeddings)).eval()
    state = to_meshlm(hf.state_dict(), cfg.layout, LLAMA)
    if cfg.tie_embeddings:
        # the same tied table
        assert torch.equal(state.pop("embed_out.weight"), state["embed_in.weight"])
    ours = MeshLM(cfg).eval()
    ours.load_state_dict(state, strict=True)
    return hf, ours


@pytest.mark.parametrize("cfg", [
    llama_cfg(),  # grouped-query attention (2 kv heads for 4 query heads)
    llama_cfg(n_kv_heads=None, mlp_hidden=None),  # multi-head attention, the default SwiGLU width
    llama_cfg(tie_embeddings=True),
    # multi-query attention; the grouping of layers does not matter a Llama-like shape: 32k
    # vocabulary, d 256, 8 heads over 2 kv heads, 2 layers
    llama_cfg(n_kv_heads=1, spec="1+1+1"),
    llama_cfg(spec="2", d_model=256, n_heads=8, n_kv_heads=2, vocab_size=32000, mlp_hidden=688,
              rotary_base=1e4),
], ids=["gqa", "mha", "tied", "mqa-grouped", "llama-like"])
def test_logits_equal_llama(cfg):
    hf, ours = llama_pair(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 33))
    with torch.no_grad():
        diff = (ours(x).logits - hf(x).logits).abs().max().item()
    assert diff <= 1e-5, diff


def test_padding_mask_matches_llama():
    cfg = llama_cfg()
    hf, ours = llama_pair(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 9:] = 0  # right padding
    with torch.no_grad():
        a = ours(x, padding_mask=mask).logits
        b = hf(x, attention_mask=mask).logits
    assert (a - b)[mask.bool()].abs().max() <= 1e-5


def test_loss_equals_llama():
    cfg = llama_cfg()
    hf, ours = llama_pair(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    targets = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], 1)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, targets=targets).loss, hf(x, labels=x).loss, rtol=0,
                                   atol=1e-5)


def test_state_dict_round_trip_is_exact():
    cfg = llama_cfg()
    hf, ours = llama_pair(cfg)
    back, reference = from_meshlm(ours.state_dict(), cfg.layout, LLAMA), hf.state_dict()
    assert set(back) == set(reference)
    assert all(torch.equal(back[k], reference[k]) for k in back)


@pytest.mark.parametrize("tied", [False, True])
def test_hf_folder_round_trip_is_exact(tmp_path, tied):
    cfg = llama_cfg(tie_embeddings=tied)
    hf, _ = llama_pair(cfg)
    hf.save_pretrained(tmp_path / "llama")
    x = torch.randint(0, cfg.vocab_size, (2, 13))
    with torch.no_grad():
        expected = hf(x).logits
    convert(tmp_path / "llama", tmp_path / "ckpt")
    from meshlm.loading import open_model

    model = open_model(tmp_path / "ckpt").model
    assert model.config.backbone == "llama" and model.config.tie_embeddings == tied
    with torch.no_grad():
        assert (model(x).logits - expected).abs().max() <= 1e-5
    convert(tmp_path / "ckpt", tmp_path / "back")  # default target: the backbone's family
    again = LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert again.config.tie_word_embeddings == tied
    with torch.no_grad():
        assert torch.equal(again(x).logits, expected)


def test_scaled_tied_model_exports_untied_with_equal_logits(tmp_path):
    """√d is folded into the input table; the output layer keeps the unscaled one, so the export
    unties."""
    from meshlm.checkpoint import save_model

    torch.manual_seed(0)
    model = MeshLM(llama_cfg(tie_embeddings=True, scale_embeddings=True)).eval()
    save_model(model, tmp_path / "ckpt")
    convert(tmp_path / "ckpt", tmp_path / "llama")
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "llama").eval()
    assert not hf.config.tie_word_embeddings
    x = torch.randint(0, 211, (2, 9))
    with torch.no_grad():
        assert (hf(x).logits - model(x).logits).abs().max() <= 1e-5


def test_unsupported_llama_variant_is_named(tmp_path):
    import json

    from meshlm.errors import ConfigError

    cfg = llama_cfg()
    hf, _ = llama_pair(cfg)
    hf.save_pretrained(tmp_path / "llama")
    raw = json.loads((tmp_path / "llama" / "config.json").read_text())
    raw.update(attention_bias=True,
               rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0})
    (tmp_path / "llama" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="Llama variant is not "
                                          "supported.*rope_type='llama3'.*attention with bias"):
        read_family(tmp_path / "llama")
