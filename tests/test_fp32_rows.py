"""fp32 decoding's compiled kernel (meshlm.runtime.fp32_rows): F.linear's product to rounding on
full, padded and narrow blocks, each row the same bits whatever else the call holds; SplitLinear
takes it up to KERNEL_ROWS rows and bmm beyond; decoding through it makes the same tokens cached,
uncached, batched and under speculation; used only where its probe found it faster."""
import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import build, tiny
from test_quant import assert_decodes_exactly

from meshlm.generate import Sampling, generate
from meshlm.runtime import fp32_rows, precision
from meshlm.runtime.split_linear import KERNEL_ROWS, KERNEL_WIDTH, SplitLinear


@pytest.fixture
def kernel(monkeypatch, tmp_path):
    """The kernel built into a cache of its own, none remembered from earlier in this process."""
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path))
    fp32_rows.fp32_rows_kernel.cache_clear()
    built = fp32_rows.fp32_rows_kernel()
    assert built is not None, "this machine has a C compiler (cc or gcc): the kernel builds"
    yield built
    fp32_rows.fp32_rows_kernel.cache_clear()


def paid(monkeypatch, speedup: float) -> None:
    """The probe's figures, as if measured: the kernel `speedup` times split's and F.linear's."""
    monkeypatch.setattr(fp32_rows, "kernel_speedup", lambda kernel: {
        "kernel_over_split": speedup, "kernel_over_linear": speedup})


@pytest.mark.parametrize("out_features, in_features", [(256, 768), (300, 64), (37, 5), (1, 1),
                                                       (129, 3072)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_kernel_is_f_linear_to_rounding_and_each_row_its_own(kernel, out_features,
                                                                 in_features, bias):
    g = torch.Generator().manual_seed(out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    layer = SplitLinear.for_kernel(linear, kernel)
    assert layer.blocks.shape[2] == min(KERNEL_WIDTH, out_features)
    x = torch.randn(KERNEL_ROWS, in_features, generator=g)
    y = layer(x)
    with torch.no_grad():
        exact = F.linear(x.double(), linear.weight.double(),
                         None if linear.bias is None else linear.bias.double())
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)
    # a row alone, in pairs or odd groups: the same bits (each output one in-order sum)
    for rows in (slice(0, 1), slice(3, 4), slice(0, 2), slice(1, 6), slice(2, 9)):
        assert torch.equal(layer(x[rows]), y[rows])


def test_longer_calls_go_through_bmm_over_the_same_blocks(kernel):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 300)
    layer = SplitLinear.for_kernel(linear, kernel)
    calls = []
    layer.kernel = lambda *args: calls.append(len(args[0])) or kernel(*args)
    for rows in (1, KERNEL_ROWS, KERNEL_ROWS + 1, 300):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(layer(x), linear(x), rtol=1e-5, atol=1e-5)
    assert calls == [1, KERNEL_ROWS]


def decoding_pair(monkeypatch, model):
    """(model laid out with the kernel, the same laid out per thread for bmm alone)."""
    paid(monkeypatch, 2.0)
    with_kernel = copy.deepcopy(model)
    _, chosen = precision.for_decoding("auto", with_kernel)
    assert precision.FP32_KERNEL_NOTE in chosen.reason
    paid(monkeypatch, 0.5)
    monkeypatch.setattr(precision, "split_speedup", lambda: 2.0)
    plain = copy.deepcopy(model)
    _, chosen = precision.for_decoding("auto", plain)
    assert precision.FP32_KERNEL_NOTE not in chosen.reason
    assert precision.SPLIT_NOTE in chosen.reason
    return with_kernel, plain


def test_decoding_through_the_kernel_makes_the_same_tokens_on_every_path(kernel, monkeypatch):
    torch.manual_seed(0)
    model = build(tiny(spec="1+1R3+1", vocab_size=512, d_model=64, context_length=64)).eval()
    with_kernel, plain = decoding_pair(monkeypatch, model)
    layers = [m for m in with_kernel.modules() if isinstance(m, SplitLinear)]
    assert layers and all(m.kernel is kernel for m in layers)
    assert not any(m.kernel for m in plain.modules() if isinstance(m, SplitLinear))
    assert_decodes_exactly(with_kernel)  # cached == uncached == speculation == batched
    s = Sampling(max_new_tokens=12, temperature=0, stop_at_eos=False)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    with torch.no_grad():
        assert generate(with_kernel, prompts, s) == generate(plain, prompts, s)


def test_a_row_decodes_the_same_logits_alone_and_in_a_batch(kernel, monkeypatch):
    torch.manual_seed(0)
    model = build(tiny(spec="1+1R2+1", vocab_size=256, d_model=64)).eval()
    with_kernel, _ = decoding_pair(monkeypatch, model)
    ids = torch.randint(2, 256, (3, 1))
    with torch.no_grad():
        batched = with_kernel(ids).logits
        for row in range(3):
            assert torch.equal(with_kernel(ids[row:row + 1]).logits[0], batched[row])


@pytest.mark.parametrize("speedup, used", [(2.0, True), (1.0, False)])
def test_the_kernel_is_used_only_where_its_probe_found_it_faster(kernel, monkeypatch, speedup,
                                                                 used):
    paid(monkeypatch, speedup)
    assert (fp32_rows.paying_kernel() is kernel) == used


def test_the_probe_times_all_three_and_is_cached(kernel, tmp_path):
    first = fp32_rows.kernel_speedup(kernel)
    assert first["kernel_ms"] > 0 and first["split_ms"] > 0 and first["linear_ms"] > 0
    assert first["kernel_over_split"] == pytest.approx(first["split_ms"] / first["kernel_ms"])
    assert "fp32-rows-kernel" in (tmp_path / "machine.json").read_text()
    assert fp32_rows.kernel_speedup(kernel) == first  # measured once, then read


def test_without_the_kernel_decoding_keeps_torchs_ops(monkeypatch, tmp_path):
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path))
    monkeypatch.setenv("MESHLM_NATIVE", "0")
    fp32_rows.fp32_rows_kernel.cache_clear()
    try:
        assert fp32_rows.fp32_rows_kernel() is None and fp32_rows.paying_kernel() is None
        model = build(tiny(spec="1+1R2+1", vocab_size=256))
        _, chosen = precision.for_decoding("auto", model)
        assert precision.FP32_KERNEL_NOTE not in chosen.reason
        assert not any(getattr(m, "kernel", None) for m in model.modules())
    finally:
        fp32_rows.fp32_rows_kernel.cache_clear()


def test_an_input_that_needs_grad_takes_bmm(kernel):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 200)
    layer = SplitLinear.for_kernel(linear, kernel)
    calls = []
    layer.kernel = lambda *args: calls.append(1) or kernel(*args)
    x = torch.randn(2, 64)
    needs_grad = x.clone().requires_grad_()  # the kernel records no graph
    torch.testing.assert_close(layer(needs_grad), linear(x), rtol=1e-5, atol=1e-5)
    assert layer(needs_grad).requires_grad
    assert calls == []
