"""int8 weight-only layers and meshlm's kernel for them (meshlm.quant.int8_bf16_kernel): within
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
from meshlm.quant import QuantizedLinear, int8_bf16_kernel, quantize_model
from meshlm.runtime import precision


@pytest.fixture
def kernel(monkeypatch, tmp_path):
    """The kernel built into a cache of its own, none remembered from earlier in this process."""
    with fresh_kernel(int8_bf16_kernel.KERNEL, monkeypatch, tmp_path) as built:
        yield built


def paying(monkeypatch, ratio: float, batch: float = 1.0) -> None:
    probe_says(monkeypatch, int8_bf16_kernel, ratio, batch)


def int8(k: int, n: int, bias: bool = True) -> QuantizedLinear:
    torch.manual_seed(0)
    return QuantizedLinear.from_linear(torch.nn.Linear(k, n, bias=bias), 8)


def assert_float64_product_and_rows_apart(product, k: int, n: int, rows: int) -> None:
    layer = int8(k, n, bias=False)
    x = torch.randn(rows, k) * torch.logspace(-2, 2, rows)[:, None]
    y = product(x, layer.qweight, layer.scales)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert close_to_float64(y, x.bfloat16().float(), layer.weight_fp32(), None)
    assert torch.equal(product(x.bfloat16(), layer.qweight, layer.scales), y)  # bf16 rows
    alone = torch.cat([product(x[i:i + 1], layer.qweight, layer.scales) for i in range(rows)])
    assert torch.equal(alone, y)


@pytest.mark.parametrize("k, n, rows", [(64, 13, 1), (768, 2304, 1), (3072, 768, 5),
                                        (200, 40, 17), (7, 3, 2), (108, 42, 3)])
def test_the_kernel_is_the_float64_product_and_a_row_the_same_in_any_batch(kernel, k, n, rows):
    assert_float64_product_and_rows_apart(kernel, k, n, rows)


@pytest.mark.parametrize("flags", OLDER_CPUS.values(), ids=OLDER_CPUS.keys())
def test_the_kernel_built_for_older_cpus_is_the_float64_product(tmp_path, flags):
    """The plain C loop (CPUs without AVX2) and the AVX2 path (CPUs without AVX-512), built on
    this CPU."""
    product = built_for(int8_bf16_kernel.KERNEL, flags, tmp_path)
    assert int8_bf16_kernel.KERNEL.check(product)
    assert_float64_product_and_rows_apart(product, 108, 42, 5)  # every path of the tiles


def test_decoding_takes_the_kernel_where_it_pays_and_keeps_tokens_exact(kernel, monkeypatch):
    paying(monkeypatch, 1.4)
    model = build(tiny(spec="1+1R4+1", vocab_size=512, d_model=64))
    quantized = quantize_model(model, 8, ("prelude", "cores", "coda"), activations="bf16")[0]
    device, chosen = decoding.for_decoding("auto", quantized)
    layers = [m for m in quantized.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.row_kernel is kernel for m in layers)
    assert (f"{decoding.INT8_BF16_KERNEL_NOTE} (1.4x torch's one-row speed here, measured once)"
            in chosen.describe())
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad(), precision.autocast(device, chosen):
        ours = quantized(ids).logits
        for layer in layers:
            layer.row_kernel = None
        theirs = quantized(ids).logits  # torch's kernel: other fp32 sums, bf16 out
        for layer in layers:
            layer.row_kernel = kernel
    assert (ours - theirs).abs().max() <= 0.05 * theirs.abs().max()
    assert_decodes_exactly(quantized)  # cached, uncached, speculation, batched


@pytest.mark.parametrize("one, batch", [(0.9, 1.2), (1.4, 0.8)])  # slower alone, or in a batch
def test_where_torchs_kernel_is_faster_the_layers_keep_it(kernel, monkeypatch, one, batch):
    paying(monkeypatch, one, batch)
    quantized = quantize_model(build(tiny(spec="1+1R2+1", vocab_size=256)), 8, ("cores",),
                               activations="bf16")[0]
    line = decoding.for_decoding("auto", quantized)[1].describe()
    assert all(m.row_kernel is None for m in quantized.modules()
               if isinstance(m, QuantizedLinear))
    # nothing missing: the probe chose torch's kernel
    assert decoding.INT8_BF16_KERNEL_NOTE not in line
    assert decoding.INT8_BF16_KERNEL_MISSING not in line


def test_without_the_kernel_the_layers_keep_torchs_and_say_so(kernel, native_off):
    quantized = quantize_model(build(tiny(spec="1+1R2+1", vocab_size=256)), 8, ("cores",),
                               activations="bf16")[0]
    line = decoding.for_decoding("auto", quantized)[1].describe()
    assert (f"{decoding.INT8_BF16_KERNEL_MISSING} (turned off by MESHLM_NATIVE=0; unset it to "
            "build the kernel), so int8 weight-only products by torch's kernel") in line
    assert all(m.row_kernel is None for m in quantized.modules()
               if isinstance(m, QuantizedLinear))


def test_int8_activation_layers_get_no_weight_only_kernel(kernel, monkeypatch):
    paying(monkeypatch, 1.4)
    quantized = quantize_model(build(tiny(spec="1+1R2+1", vocab_size=256)), 8, ("cores",),
                               activations="int8")[0]
    assert int8_bf16_kernel.give(quantized) == 0.0
    assert int8_bf16_kernel.unavailable(quantized) is None


def test_a_compiled_step_calls_the_kernel_as_its_operator(kernel):
    layer = int8(128, 48)
    layer.row_kernel = kernel
    x = torch.randn(1, 128)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    with torch.no_grad():
        assert torch.equal(compiled(x), layer(x))
    assert torch.equal(layer(x), kernel(x, layer.qweight, layer.scales) + layer.bias)


def test_the_probe_races_the_kernel_against_torchs(kernel, monkeypatch):
    monkeypatch.setattr(int8_bf16_kernel, "PROBE_MB", 2)  # a quick race: the figures' shape
    figures = int8_bf16_kernel._probe(kernel, reps=1)
    for prefix in ("", "batch_"):  # one row, and a served batch's rows
        assert figures[f"{prefix}kernel_over_torch"] == pytest.approx(
            figures[f"{prefix}torch_ms"] / figures[f"{prefix}kernel_ms"])
