"""Per-loop LoRA (relaxed recursion): zero deltas are the base model, equal deltas are one shared
(PEFT) LoRA, each pass gets its own delta in every path (cache, exit, speculation, checkpointed
backward), deeper loops reuse the last delta, and the accounting counts r·(in + out) per targeted
Linear per pass."""
import pytest
import torch
from conftest import build, tiny
from test_exit import decode, mid_threshold, x_batch
from test_kv_cache import decode_both_ways

from meshlm.errors import ConfigError
from meshlm.model.accounting import describe
from meshlm.model.exit import ExitRule
from meshlm.model.loop_lora import LoopLoRALinear, LowRank

RANK = 4


def randomise_deltas(model, seed=1, scale=0.3):
    """Every pass's B non-zero (at init B = 0), each pass different."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LowRank):
                m.B.copy_(torch.randn(m.B.shape, generator=g) * scale)
    return model


def lora_model(**overrides):
    return build(tiny(**{"loop_lora_rank": RANK, **overrides}))


@pytest.mark.parametrize("backbone", ["neox", "llama", "olmoe"])
def test_zero_initialised_deltas_are_the_base_model_exactly(backbone):
    extra = {"n_kv_heads": 2} if backbone == "llama" else {}
    base = build(tiny(backbone=backbone, **extra))
    lora = build(tiny(backbone=backbone, loop_lora_rank=RANK, **extra))
    shared = {k: v for k, v in lora.state_dict().items() if "loop_lora" not in k}
    assert shared.keys() == base.state_dict().keys()
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in shared.items())  # same init draws
    x = x_batch()
    with torch.no_grad():
        assert torch.equal(lora(x).logits, base(x).logits)


def test_rank_zero_is_the_base_model():
    assert build(tiny(loop_lora_rank=0)).state_dict().keys() == build(tiny()).state_dict().keys()


def test_equal_deltas_are_one_shared_peft_lora():
    from peft import LoraConfig, inject_adapter_in_model

    model = randomise_deltas(lora_model(scheme="base"))
    first = {}
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, LoopLoRALinear):
                a, b = m.loop_lora[0].A, m.loop_lora[0].B
                for delta in m.loop_lora:
                    delta.A.copy_(a), delta.B.copy_(b)
                first[name] = (a.clone(), b.clone())
    shared = build(tiny(scheme="base"))
    shared.load_state_dict({k: v for k, v in model.state_dict().items() if "loop_lora" not in k})
    shared = inject_adapter_in_model(LoraConfig(r=RANK, lora_alpha=RANK,
                                                target_modules=list(first)), shared)
    with torch.no_grad():
        for name, (a, b) in first.items():
            module = shared.get_submodule(name)
            module.lora_A["default"].weight.copy_(a)
            module.lora_B["default"].weight.copy_(b)
        x = x_batch()
        torch.testing.assert_close(model(x).logits, shared(x).logits, rtol=1e-5, atol=1e-5)


def test_each_pass_uses_its_own_delta():
    model = randomise_deltas(lora_model(scheme="base"))
    x = x_batch()
    with torch.no_grad():
        before = model(x).logits
        for m in model.modules():
            if isinstance(m, LoopLoRALinear):
                m.loop_lora[1].B.zero_()  # the second pass's delta only
        assert not torch.equal(model(x).logits, before)
        assert torch.equal(model(x, loops=1).logits, model(x, loops=1).logits)


def test_depth_beyond_the_last_trained_delta_reuses_it():
    """Cap 2, run 4 loops == a cap-4 model whose passes 2 and 3 hold copies of pass 1's delta."""
    capped = randomise_deltas(lora_model(scheme="base"))
    deeper = lora_model(scheme="base", max_loops=4)
    state = deeper.state_dict()
    for key in state:
        if ".loop_lora." in key:
            prefix, rest = key.split(".loop_lora.")
            index, leaf = rest.split(".", 1)
            state[key] = capped.state_dict()[f"{prefix}.loop_lora.{min(int(index), 1)}.{leaf}"]
        else:
            state[key] = capped.state_dict()[key]
    deeper.load_state_dict(state)
    x = x_batch()
    with torch.no_grad():
        torch.testing.assert_close(capped(x, loops=4).logits, deeper(x, loops=4).logits, rtol=0,
                                   atol=0)
        assert not torch.equal(capped(x, loops=4).logits, capped(x, loops=2).logits)


@pytest.mark.parametrize("scheme", ["mesh", "base"])
def test_cached_decoding_equals_uncached_left_padded(scheme):
    model = randomise_deltas(build(tiny(scheme=scheme, spec="1+2R2+1", loop_lora_rank=RANK,
                                        max_loops=3)))
    for loops in (None, 3):
        worst, _ = decode_both_ways(model, loops=loops, steps=6)
        assert worst <= 1e-5, (loops, worst)


def test_cached_decoding_equals_uncached_with_exit():
    model = randomise_deltas(build(tiny(spec="1+1R2+1", max_loops=4, loop_lora_rank=RANK)))
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]
    rule = ExitRule("state", mid_threshold(model, x_batch(), "state"))
    cached, cached_loops = decode(model, prompts, 6, rule, cache=True)
    full, full_loops = decode(model, prompts, 6, rule, cache=False)
    assert torch.equal(cached_loops, full_loops)
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-5)


def test_greedy_speculation_is_plain_greedy():
    from meshlm.generate import Sampling, generate
    from meshlm.generate.speculative import Speculation

    model = randomise_deltas(build(tiny(spec="1+2R4+1", context_length=96, loop_lora_rank=RANK)),
                             scale=0.1)
    s = Sampling(max_new_tokens=24, temperature=0, stop_at_eos=False)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    assert generate(model, prompts, s, speculate=Speculation(2, 3)) == generate(model, prompts, s)


def test_checkpointed_backward_sees_each_pass_delta():
    from meshlm.train.parallel import checkpoint_layers

    def grads(checkpointed):
        model = randomise_deltas(lora_model(scheme="base")).train()
        if checkpointed:
            checkpoint_layers(model)
        x = x_batch()
        model(x, targets=x).loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}

    plain, recomputed = grads(False), grads(True)
    for name, g in plain.items():
        torch.testing.assert_close(recomputed[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_accounting_counts_every_pass_delta():
    # 1 core layer: qkv 32->96, dense 32->32, MLP 32->128->32
    cfg = tiny(loop_lora_rank=RANK, max_loops=3)
    per_pass = RANK * ((32 + 96) + (32 + 32) + (32 + 128) + (128 + 32))
    acc, base = describe(cfg), describe(tiny(max_loops=3))
    assert acc.loop_lora_params == 3 * per_pass
    assert acc.total_params == base.total_params + 3 * per_pass
    # K = 2 passes
    assert acc.forward_flops_per_token == base.forward_flops_per_token + 2 * 2 * per_pass


@pytest.mark.parametrize("overrides, needle", [
    (dict(spec="1+2+1", scheme="base"), "needs a shared core"),
    (dict(loop_lora_rank=-1), "loop_lora_rank=-1"),
    (dict(loop_lora_targets="nothing_here"), "matches no Linear"),
])
def test_bad_settings_are_one_line_errors(overrides, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        build(tiny(**{"loop_lora_rank": RANK, **overrides}))
    assert "\n" not in str(err.value)


def test_hugging_face_export_carries_the_deltas(tmp_path):
    from meshlm.hf import load_hf, save_hf
    from meshlm.hf.remote import MODELING_FILE

    model = randomise_deltas(lora_model())
    save_hf(model, tmp_path / "hf")
    # trust_remote_code has it
    assert "class LoopLoRALinear" in (tmp_path / "hf" / MODELING_FILE).read_text()
    x = x_batch()
    with torch.no_grad():
        assert torch.equal(load_hf(tmp_path / "hf").model(x).logits, model(x).logits)
