"""int4 weight-only layers and meshlm's kernel for them (meshlm.quant.int4_bf16_kernel): within
fp32 rounding of the float64 product of the bf16-rounded rows, a row's outputs the same alone or
in a batch at every row count, so decoding through it keeps cached, uncached, speculative and
batched tokens equal; given where its probe finds it faster than torch's kernel, named on the
precision line, and where it cannot be built the layers keep torch's kernel and the line says
why."""
import pytest
import torch
from conftest import OLDER_CPUS, build, built_for, fresh_kernel, probe_says, tiny
from test_quant import assert_decodes_exactly

from meshlm import decoding
from meshlm.kernels.kernel import close_to_float64
from meshlm.quant import QuantizedLinear, int4_bf16_kernel, quantize_model
from meshlm.runtime import precision


@pytest.fixture
def kernel(monkeypatch, tmp_path):
    """The kernel built into a cache of its own, none remembered from earlier in this process."""
    with fresh_kernel(int4_bf16_kernel.KERNEL, monkeypatch, tmp_path) as built:
        yield built


def paying(monkeypatch, ratio: float, batch: float = 1.0) -> None:
    probe_says(monkeypatch, int4_bf16_kernel, ratio, batch)


def int4(k: int, n: int, group: int, bias: bool = True) -> QuantizedLinear:
    torch.manual_seed(0)
    return QuantizedLinear.from_linear(torch.nn.Linear(k, n, bias=bias), 4, group)


@pytest.mark.parametrize("k, n, group, rows", [(64, 13, 32, 1), (768, 2304, 64, 1),
                                               (3072, 768, 128, 5), (256, 40, 256, 17)])
def test_the_kernel_is_the_float64_product_and_a_row_the_same_in_any_batch(kernel, k, n, group,
                                                                           rows):
    layer = int4(k, n, group, bias=False)
    x = torch.randn(rows, k) * torch.logspace(-2, 2, rows)[:, None]
    packed, sz = layer._int4_rows_operands()
    y = kernel(x, packed, sz, n, group)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert close_to_float64(y, x.bfloat16().float(), layer.weight_fp32(), None)
    assert torch.equal(kernel(x.bfloat16(), packed, sz, n, group), y)  # the rows it multiplies
    alone = torch.cat([kernel(x[i:i + 1], packed, sz, n, group) for i in range(rows)])
    assert torch.equal(alone, y)


def test_tiny_and_huge_activations_keep_the_float64_product(kernel):
    """The AVX2 loop multiplies each nibble kept in place (q 2^s) by its activation scaled by
    2^-s: exact down to |x| ~ 2^-102, below which only digits far under fp32's rounding of the
    sum are lost; rows from 1e-35 to 1e30 stay the float64 product, finite, alone or batched."""
    layer = int4(768, 48, 64, bias=False)
    packed, sz = layer._int4_rows_operands()
    x = torch.randn(6, 768) * torch.tensor([1e-35, 1e-31, 1e-20, 1.0, 1e20, 1e30])[:, None]
    y = kernel(x, packed, sz, 48, 64)
    assert torch.isfinite(y).all()
    assert close_to_float64(y, x.bfloat16().float(), layer.weight_fp32(), None)
    alone = torch.cat([kernel(x[i:i + 1], packed, sz, 48, 64) for i in range(6)])
    assert torch.equal(alone, y)


@pytest.mark.parametrize("policy", ["auto", "bf16"])  # bf16 forced, as native-bf16 CPUs run it
def test_decoding_takes_the_kernel_where_it_pays_and_keeps_tokens_exact(kernel, monkeypatch,
                                                                        policy):
    paying(monkeypatch, 1.4)
    torch.manual_seed(0)
    model = build(tiny(spec="1+1R4+1", vocab_size=512, d_model=64))
    quantized = quantize_model(model, 4, ("prelude", "cores", "coda"), group_size=32)[0]
    device, chosen = decoding.for_decoding(policy, quantized)
    layers = [m for m in quantized.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.row_kernel is kernel for m in layers)
    assert (f"{decoding.INT4_BF16_KERNEL_NOTE} (1.4x torch's one-row speed here, measured once)"
            in chosen.describe())
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad(), precision.autocast(device, chosen):
        ours = quantized(ids).logits
        for layer in layers:
            layer.row_kernel = None
        theirs = quantized(ids).logits  # torch's kernel: other fp32 sums, bf16 out
        for layer in layers:
            layer.row_kernel = kernel
    assert (ours.float() - theirs.float()).abs().max() <= 0.05 * theirs.float().abs().max()
    if policy == "auto":  # fp32, where greedy output does not depend on batching or speculation
        assert_decodes_exactly(quantized)  # cached, uncached, speculation, batched


@pytest.mark.parametrize("one, batch", [(0.9, 1.2), (1.4, 0.8)])  # slower alone, or in a batch
def test_where_torchs_kernel_is_faster_the_layers_keep_it(kernel, monkeypatch, one, batch):
    paying(monkeypatch, one, batch)
    quantized = quantize_model(build(tiny(spec="1+1R2+1", vocab_size=256)), 4, ("cores",),
                               group_size=32)[0]
    line = decoding.for_decoding("auto", quantized)[1].describe()
    assert all(m.row_kernel is None for m in quantized.modules()
               if isinstance(m, QuantizedLinear))
    assert "int4 weight-only" not in line  # nothing missing: the probe chose torch's kernel


def test_without_the_kernel_the_layers_keep_torchs_and_say_so(kernel, native_off):
    quantized = quantize_model(build(tiny(spec="1+1R2+1", vocab_size=256)), 4, ("cores",),
                               group_size=32)[0]
    line = decoding.for_decoding("auto", quantized)[1].describe()
    assert (f"{decoding.INT4_BF16_KERNEL_MISSING} (turned off by MESHLM_NATIVE=0; unset it to "
            "build the kernel), so int4 weight-only products by torch's kernel") in line
    assert all(m.row_kernel is None for m in quantized.modules()
               if isinstance(m, QuantizedLinear))


def test_w4a8_layers_get_no_weight_only_kernel(kernel, monkeypatch):
    paying(monkeypatch, 1.4)
    quantized = quantize_model(build(tiny(spec="1+1R2+1", vocab_size=256)), 4, ("cores",),
                               group_size=32, activations="int8")[0]
    assert int4_bf16_kernel.give(quantized) == 0.0
    assert int4_bf16_kernel.unavailable(quantized) is None


def test_a_compiled_step_calls_the_kernel_as_its_operator(kernel):
    layer = int4(128, 48, 32)
    layer.row_kernel = kernel
    x = torch.randn(1, 128)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    with torch.no_grad():
        assert torch.equal(compiled(x), layer(x))
    packed, sz = layer._int4_rows_operands()
    assert torch.equal(layer(x), kernel(x, packed, sz, 48, 32) + layer.bias)


def test_the_probe_races_the_kernel_against_torchs(kernel, monkeypatch):
    monkeypatch.setattr(int4_bf16_kernel, "PROBE_MB", 2)  # a quick race: the figures' shape
    figures = int4_bf16_kernel._probe(kernel, reps=1)
    for prefix in ("", "batch_"):  # one row, and a served batch's rows
        assert {f"{prefix}kernel_over_torch", f"{prefix}torch_ms", f"{prefix}kernel_ms"} <= set(
            figures)
        assert figures[f"{prefix}kernel_over_torch"] == pytest.approx(
            figures[f"{prefix}torch_ms"] / figures[f"{prefix}kernel_ms"])


@pytest.mark.parametrize("flags", OLDER_CPUS.values(), ids=OLDER_CPUS.keys())
def test_the_kernel_built_for_older_cpus_is_the_float64_product(tmp_path, flags):
    """Built without -march=native: the plain C loop, as on CPUs without AVX2; built for this CPU
    less AVX512_BF16: the fused multiply-adds, as on AVX512 CPUs without vdpbf16ps; less AVX512:
    the multiply-adds eight outputs at a time, as on AVX2 CPUs."""
    product = built_for(int4_bf16_kernel.KERNEL, flags, tmp_path)
    assert int4_bf16_kernel._close(product)
    layer = int4(256, 40, 64, bias=False)
    packed, sz = layer._int4_rows_operands()
    x = torch.randn(6, 256)
    alone = torch.cat([product(x[i:i + 1], packed, sz, 40, 64) for i in range(6)])
    assert torch.equal(alone, product(x, packed, sz, 40, 64))
