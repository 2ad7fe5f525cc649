"""meshlm's olmoe backbone is OLMoE: logits and auxiliary losses equal transformers'
OlmoeForCausalLM with copied weights; dispatch computes only the selected experts; conversion is
exact; accounting is honest."""
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import OlmoeForCausalLM

from meshlm.backbones import BACKBONES
from meshlm.config import ModelConfig
from meshlm.interop.convert import convert
from meshlm.interop.families import from_meshlm, hf_config, split_experts, stack_experts, to_meshlm
from meshlm.model import MeshLM
from meshlm.model.accounting import describe
from meshlm.model.moe import SparseMoE

OLMOE = BACKBONES["olmoe"]


def olmoe_cfg(**overrides) -> ModelConfig:
    base = dict(spec="3", d_model=64, n_heads=4, n_kv_heads=2, vocab_size=211, context_length=64,
                mlp_hidden=48,
                n_experts=6, top_k=2, backbone="olmoe", scheme="vanilla", scale_embeddings=False)
    return ModelConfig(**{**base, **overrides})


def olmoe_pair(cfg: ModelConfig):
    torch.manual_seed(0)
    hf = OlmoeForCausalLM(hf_config(cfg, OLMOE)).eval()
    with torch.no_grad():  # transformers' init leaves the QK-norm weights at 1: make them matter
        for name, p in hf.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    ours = MeshLM(cfg).eval()
    ours.load_state_dict(to_meshlm(hf.state_dict(), cfg.layout, OLMOE), strict=True)
    return hf, ours


def z_loss_of(router_logits, mask=None):
    """Router z-loss transcribed: mean over router calls and (real) tokens of logsumexp(logits)²."""
    z = torch.stack([torch.logsumexp(r, -1) ** 2 for r in router_logits])  # (L, N)
    if mask is None:
        return z.mean()
    m = mask.reshape(-1).float()
    return (z * m).sum() / (m.sum() * len(router_logits))


@pytest.mark.parametrize("cfg", [
    olmoe_cfg(),
    olmoe_cfg(norm_topk_prob=True, n_kv_heads=None),
    olmoe_cfg(n_experts=4, top_k=4, spec="2"),  # every expert for every token
], ids=["olmoe", "normalised-topk-mha", "all-experts"])
def test_logits_and_auxiliary_losses_equal_olmoe(cfg):
    hf, ours = olmoe_pair(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 17))
    with torch.no_grad():
        ref = hf(x, output_router_logits=True)
        out = ours(x)
    assert (out.logits - ref.logits).abs().max() <= 1e-5
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.z_loss, z_loss_of(ref.router_logits), rtol=0, atol=1e-5)


def test_training_loss_adds_the_weighted_auxiliary_losses_like_olmoe():
    """transformers adds router_aux_loss_coef·aux_loss to the loss (no z-loss); meshlm adds both, in
    train mode."""
    cfg = olmoe_cfg(aux_loss_weight=0.05, z_loss_weight=0.0)
    hf, ours = olmoe_pair(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    targets = torch.cat([x[:, 1:], torch.full_like(x[:, :1], -100)], 1)
    with torch.no_grad():
        ref = hf(x, labels=x, output_router_logits=True).loss
        train = ours.train()(x, targets=targets)
        evaluation = ours.eval()(x, targets=targets)
    torch.testing.assert_close(train.loss, ref, rtol=0, atol=1e-5)
    assert torch.equal(evaluation.loss, evaluation.lm_loss)  # eval: plain cross-entropy
    zmodel = MeshLM(cfg.replace(z_loss_weight=0.01)).train()
    zmodel.load_state_dict(ours.state_dict())
    with torch.no_grad():
        out = zmodel(x, targets=targets)
    torch.testing.assert_close(out.loss, out.lm_loss + 0.05 * out.aux_loss + 0.01 * out.z_loss)


def test_padding_is_left_out_of_the_auxiliary_losses_like_olmoe():
    cfg = olmoe_cfg()
    hf, ours = olmoe_pair(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, 8:] = 0
    with torch.no_grad():
        ref = hf(x, attention_mask=mask, output_router_logits=True)
        out = ours(x, padding_mask=mask)
    assert (out.logits - ref.logits)[mask.bool()].abs().max() <= 1e-5
    torch.testing.assert_close(out.aux_loss, ref.aux_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.z_loss, z_loss_of(ref.router_logits, mask), rtol=0, atol=1e-5)


def test_every_pass_of_a_looped_core_contributes_router_logits():
    model = MeshLM(olmoe_cfg(spec="1+2R3+1", scheme="mesh")).eval()
    x = torch.randint(0, 211, (2, 9))
    out = model(x, return_states=True)
    logits = out.stages.router_logits
    assert len(logits) == model.config.layout.unrolled_depth == 8
    assert all(r.shape == (18, 6) for r in logits)
    # the same core layer, a different pass and input
    assert not torch.allclose(logits[1], logits[3])


# -- dispatch --------------------------------------------------------------------------------------
class CountRows(TorchFunctionMode):
    """Counts the rows every expert matmul sees (F.linear calls whose weight is an expert's)."""

    def __init__(self, widths):
        super().__init__()
        self.widths, self.rows = widths, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear and tuple(args[1].shape) in self.widths:
            self.rows += args[0].shape[0]
        return func(*args, **(kwargs or {}))


def dense_reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, weighted by the (top-k, else zero) routing weights: the slow
    definition."""
    flat = x.reshape(-1, x.shape[-1])
    _, weights, chosen = moe.gate(flat)
    dense = torch.zeros(flat.shape[0], moe.experts.gate_up_proj.shape[0]).scatter(1, chosen,
                                                                                  weights)
    out = 0
    for e, (gate_up, down) in enumerate(zip(moe.experts.gate_up_proj, moe.experts.down_proj)):
        gate, up = F.linear(flat, gate_up).chunk(2, -1)
        out = out + dense[:, e:e + 1] * F.linear(F.silu(gate) * up, down)
    return out.view_as(x)


@pytest.mark.parametrize("normalise", [False, True])
def test_sparse_dispatch_equals_the_dense_definition_and_computes_only_selected_experts(normalise):
    cfg = olmoe_cfg(n_experts=8, top_k=3, norm_topk_prob=normalise)
    torch.manual_seed(0)
    layer = MeshLM(cfg).cores[0][0].mlp
    x = torch.randn(3, 10, cfg.d_model)
    widths = {tuple(layer.experts.gate_up_proj.shape[1:]), tuple(layer.experts.down_proj.shape[1:])}
    with CountRows(widths) as counter:
        y = layer(x)
    assert counter.rows == 2 * 30 * 3  # N·k rows through each of the two matmuls: no dense fallback
    torch.testing.assert_close(y, dense_reference(layer, x), rtol=0, atol=1e-5)


def test_unselected_experts_get_zero_gradient_and_selected_ones_a_real_one():
    cfg = olmoe_cfg(n_experts=8, top_k=1)
    layer = MeshLM(cfg).cores[0][0].mlp
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[5] = 1.0  # expert 5 wins for inputs along +1
    x = torch.ones(2, 4, cfg.d_model)
    layer(x).sum().backward()
    grads = layer.experts.gate_up_proj.grad.flatten(1).abs().sum(-1)
    assert grads[5] > 0 and grads[torch.arange(8) != 5].sum() == 0


def test_gradcheck_float64_through_router_and_experts():
    cfg = olmoe_cfg(d_model=8, n_heads=2, n_kv_heads=None, mlp_hidden=4, n_experts=4, top_k=2,
                    norm_topk_prob=True)
    layer = MeshLM(cfg).cores[0][0].mlp.double()
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    names = ["gate.weight", "experts.gate_up_proj", "experts.down_proj"]
    params = dict(layer.named_parameters())

    def f(*tensors):
        return torch.func.functional_call(layer, dict(zip(names, tensors)), (x,))

    inputs = tuple(params[n].detach().clone().requires_grad_(True) for n in names)
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6)


def test_auxiliary_losses_reach_the_router():
    model = MeshLM(olmoe_cfg(spec="1+1R2+1", scheme="mesh")).train()
    x = torch.randint(0, 211, (2, 8))
    out = model(x)
    (out.aux_loss + out.z_loss).backward()
    assert all(model.get_parameter(f"{n}.mlp.gate.weight").grad.abs().sum() > 0
               for n in ["prelude.0", "cores.0.0", "coda.0"])


def test_uniform_routing_gives_the_minimum_balance_loss_k():
    from meshlm.model.moe import router_losses

    balance, z = router_losses([torch.zeros(12, 4), torch.zeros(12, 4)], n_experts=4, top_k=2)
    assert (balance.item() == pytest.approx(2.0)
            and z.item() == pytest.approx(torch.log(torch.tensor(4.0)).item() ** 2))


# -- conversion ------------------------------------------------------------------------------------
def test_state_dict_round_trip_and_per_expert_files_are_exact():
    cfg = olmoe_cfg()
    hf, ours = olmoe_pair(cfg)
    back, reference = from_meshlm(ours.state_dict(), cfg.layout, OLMOE), hf.state_dict()
    assert set(back) == set(reference) and all(torch.equal(back[k], reference[k]) for k in back)
    files = split_experts(back)
    assert ("model.layers.0.mlp.experts.5.up_proj.weight" in files
            and len(files) == len(back) + 3 * (3 * 6 - 2))
    restacked = stack_experts(files)
    assert all(torch.equal(restacked[k], back[k]) for k in back)


def test_hf_folder_round_trip_is_exact(tmp_path):
    from meshlm.loading import open_model

    cfg = olmoe_cfg()
    hf, _ = olmoe_pair(cfg)
    hf.save_pretrained(tmp_path / "olmoe")  # transformers writes one matrix per expert
    x = torch.randint(0, cfg.vocab_size, (2, 13))
    with torch.no_grad():
        expected = hf(x).logits
    convert(tmp_path / "olmoe", tmp_path / "ckpt")
    model = open_model(tmp_path / "ckpt").model
    assert (model.config.backbone, model.config.n_experts, model.config.top_k) == ("olmoe", 6, 2)
    with torch.no_grad():
        assert (model(x).logits - expected).abs().max() <= 1e-5
    convert(tmp_path / "ckpt", tmp_path / "back")
    again = OlmoeForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        assert torch.equal(again(x).logits, expected)


# -- accounting ------------------------------------------------------------------------------------
def test_active_parameters_and_flops_count_k_of_e_experts():
    cfg = olmoe_cfg()
    acc = describe(cfg)
    d, kv, e, k, w = 64, 2 * 16, 6, 2, 48
    attention = d * d * 2 + 2 * d * kv + d + kv  # q, o; k, v; q_norm, k_norm
    expert = 3 * d * w
    per_layer = attention + d * e + e * expert + 2 * d  # + router + experts + two RMSNorms
    assert acc.non_embedding_params == 3 * per_layer + d
    assert acc.total_params - acc.active_params == 3 * (e - k) * expert
    layer_matmul = d * d * 2 + 2 * d * kv + d * e + k * expert
    assert acc.forward_flops_per_token == 3 * (2 * layer_matmul + 4 * d * 64) + 2 * d * 211
    assert (acc.experts, acc.experts_per_token) == (6, 2)


def test_olmoe_1b_7b_shape_matches_its_published_size():
    acc = describe(ModelConfig.from_preset("olmoe-1b-7b"))
    assert acc.total_params == 6_919_161_856  # "OLMoE-1B-7B": 6.9B total
    assert round(acc.active_params / 1e9, 2) == 1.28  # 1.3B active


def test_paper_olmoe_comparison_shape():
    vanilla = describe(ModelConfig.from_preset("olmoe-2.6b-a512m"))
    assert (round(vanilla.total_params / 1e9, 1) == 2.6
            and round(vanilla.active_params / 1e6, -1) == 510)
    looped = describe(ModelConfig.from_preset("olmoe-2.6b-a512m-4+8R2+4"))
    assert looped.unrolled_layers == 24 and looped.slots == 5
    assert (looped.forward_flops_per_token - looped.scheme_flops_per_token
            == vanilla.forward_flops_per_token)
