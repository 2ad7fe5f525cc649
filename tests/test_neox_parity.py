"""meshlm vanilla is Pythia: same logits as transformers' GPTNeoXForCausalLM with the same
weights."""
import pytest
import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

from meshlm.backbones import BACKBONES
from meshlm.config import ModelConfig
from meshlm.interop.families import from_meshlm, hf_config_kwargs, to_meshlm
from meshlm.model import MeshLM


def neox_pair(cfg: ModelConfig):
    torch.manual_seed(0)
    hf = GPTNeoXForCausalLM(GPTNeoXConfig(**hf_config_kwargs(cfg, BACKBONES["neox"]))).eval()
    ours = MeshLM(cfg).eval()
    ours.load_state_dict(to_meshlm(hf.state_dict(), cfg.layout, BACKBONES["neox"]), strict=True)
    return hf, ours


@pytest.mark.parametrize("cfg", [
    ModelConfig(spec="3", d_model=64, n_heads=4, vocab_size=211, context_length=64,
                scheme="vanilla",
                scale_embeddings=False),
    # Pythia-160M's exact shape (12 layers, d 768, 12 heads, 50,304-row vocabulary)
    ModelConfig.from_preset("pythia-160m", scale_embeddings=False),
], ids=["tiny", "pythia-160m"])
def test_vanilla_logits_equal_gpt_neox(cfg):
    hf, ours = neox_pair(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 33))
    with torch.no_grad():
        diff = (ours(x).logits - hf(x).logits).abs().max().item()
    assert diff <= 1e-5, diff


def test_non_shared_spec_maps_layers_in_order():
    """A vanilla "1+2+1+1" model is the same 5-layer GPT-NeoX stack, whatever the grouping."""
    cfg = ModelConfig(spec="1+2+1+1", d_model=32, n_heads=4, vocab_size=50, scheme="vanilla",
                      scale_embeddings=False)
    hf, ours = neox_pair(cfg)
    x = torch.randint(0, 50, (3, 17))
    with torch.no_grad():
        assert (ours(x).logits - hf(x).logits).abs().max() <= 1e-5


def test_padding_mask_matches_gpt_neox():
    cfg = ModelConfig(spec="2", d_model=32, n_heads=4, vocab_size=50, scheme="vanilla",
                      scale_embeddings=False)
    hf, ours = neox_pair(cfg)
    x = torch.randint(0, 50, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 9:] = 0  # right padding: real positions must not see the pads
    with torch.no_grad():
        a = ours(x, padding_mask=mask).logits
        b = hf(x, attention_mask=mask).logits
    assert (a - b)[mask.bool()].abs().max() <= 1e-5


def test_state_dict_round_trip_is_exact():
    cfg = ModelConfig(spec="4", d_model=32, n_heads=4, vocab_size=50, scheme="vanilla")
    hf, ours = neox_pair(cfg)
    back = from_meshlm(ours.state_dict(), cfg.layout, BACKBONES["neox"])
    reference = hf.state_dict()
    assert set(back) == set(reference)
    assert all(torch.equal(back[k], reference[k]) for k in back)


@pytest.mark.parametrize("rotary_pct", [0.25, 1.0], ids=["pythia-partial", "every-dim"])
def test_rotary_equals_transformers_bit_for_bit(rotary_pct):
    """meshlm rotates with a roll and a signed sin table; transformers splits, negates and
    concatenates: the same numbers, exactly, on a strided q (a view of the fused qkv)."""
    from transformers.models.gpt_neox.modeling_gpt_neox import (
        GPTNeoXRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    from meshlm.model.layers import RotaryEmbedding, apply_rotary

    cfg = ModelConfig(spec="1", d_model=128, n_heads=2, vocab_size=64, context_length=64,
                      scheme="vanilla", rotary_pct=rotary_pct)
    positions = torch.arange(40).reshape(2, 20)
    q = torch.randn(2, 20, cfg.n_heads, 3 * cfg.head_dim).transpose(1, 2)[..., :cfg.head_dim]
    hf_config = GPTNeoXConfig(**hf_config_kwargs(cfg, BACKBONES["neox"]))
    cos, sin = GPTNeoXRotaryEmbedding(config=hf_config)(q, positions)
    ours = apply_rotary(q, RotaryEmbedding(cfg.rotary_dims, cfg.rotary_base)(positions,
                                                                               torch.float32))
    assert torch.equal(ours, apply_rotary_pos_emb(q, q, cos, sin)[0])
