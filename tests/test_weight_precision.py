"""Weights follow the compute precision (meshlm.runtime.precision.store_weights): under bf16 every
nn.Linear is stored in bf16, with numbers bit-identical to bf16 autocast over fp32 weights; decoding
under auto stays fp32."""
import copy

import pytest
import torch
from conftest import build, tiny
from test_decode_precision import bf16_machine  # noqa: F401 (fixture)

from meshlm.decoding import for_decoding
from meshlm.generate import Sampling, generate
from meshlm.runtime import precision, split_linear
from meshlm.runtime.bf16_linear import Bf16Linear
from meshlm.runtime.split_linear import SplitLinear

CPU = torch.device("cpu")


def linear_dtypes(model) -> set[torch.dtype]:
    """The weight dtypes of the model's plain linear layers (bf16 decoding's kernel layers are
    plain nn.Linear over the same weight)."""
    return {m.weight.dtype for m in model.modules() if type(m) in (torch.nn.Linear, Bf16Linear)}


@pytest.mark.parametrize("cfg", [tiny(spec="1+1R3+1", vocab_size=256),
                                 tiny(spec="1+2R2+1", backbone="llama",
                                      tie_embeddings=True,
                                      vocab_size=256)])
def test_stored_bf16_weights_compute_exactly_what_autocast_computes(cfg):
    model = build(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    bf16 = precision.Precision(torch.bfloat16, "as requested")
    with torch.no_grad(), precision.autocast(CPU, bf16):
        reference = model(ids[:, :-1], ids[:, 1:])
        stored = copy.deepcopy(model)
        precision.store_weights(stored, bf16)
        assert linear_dtypes(stored) == {torch.bfloat16}
        # the table (and the tied head) stays fp32
        assert stored.embed_in.weight.dtype == torch.float32
        out = stored(ids[:, :-1], ids[:, 1:])
        s = Sampling(max_new_tokens=8, temperature=0, stop_at_eos=False)
        assert generate(stored, [[3, 4, 5]], s) == generate(model, [[3, 4, 5]], s)
    assert torch.equal(out.logits, reference.logits) and torch.equal(out.loss, reference.loss)


def test_the_policy_stores_weights_in_the_precision_it_computes_in(bf16_machine,  # noqa: F811
                                                                   monkeypatch):
    monkeypatch.setattr(split_linear, "split_speedup", lambda: 1.7)  # the probe's finding here
    decoding, evaluating = build(tiny()), build(tiny())
    plain = sum(type(m) is torch.nn.Linear for m in decoding.modules())
    assert for_decoding("auto", decoding)[1].dtype is None
    # decoding under auto: fp32, exact across paths, every plain Linear laid out for decoding
    split = [m for m in decoding.modules() if isinstance(m, SplitLinear)]
    # with the compiled kernel, MeSH's routers take a product of their own too (whether the kernel
    # is ready depends on this machine and process, so count what took one)
    routed = sum(getattr(m, "product", None) is not None for m in decoding.modules())
    assert len(split) == plain + routed and plain > 0 and linear_dtypes(decoding) == set()
    assert {m.blocks.dtype for m in split} == {torch.float32}
    assert precision.for_model("auto", evaluating)[1].dtype == torch.bfloat16
    assert linear_dtypes(evaluating) == {torch.bfloat16}
    asked = build(tiny())
    for_decoding("bf16", asked)
    assert linear_dtypes(asked) == {torch.bfloat16}
