"""int4 weights with int8 activations (w4a8) and the kernel compiled for them
(meshlm.quant.int4_kernel): the torch ops are the exact group sums scaled in a fixed order, the
dequantized product on the rounded activations to fp32 rounding; the kernel gives their numbers
bit for bit at every row count, so decoding through it changes no token; where it cannot be built
the layers keep the torch ops and the precision line says why."""
import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import OLDER_CPUS, build, built_for, fresh_kernel, tiny
from test_quant import assert_decodes_exactly

from meshlm import decoding
from meshlm.generate import Sampling, generate
from meshlm.quant import QuantizedLinear, int4_kernel, quantize_model
from meshlm.quant.linear import int4_int8_products, quantize_rows
from meshlm.runtime import precision


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """The kernel built into a cache of its own, none remembered from earlier in this process."""
    with fresh_kernel(int4_kernel.KERNEL, monkeypatch, tmp_path):
        yield tmp_path / "kernels"


def w4a8(k: int, n: int, group: int, seed: int = 0) -> tuple[QuantizedLinear, torch.nn.Linear]:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(k, n)
    return QuantizedLinear.from_linear(linear, 4, group, activations="int8"), linear


@pytest.mark.parametrize("k, n, group", [(64, 13, 32), (256, 48, 64), (768, 100, 256)])
def test_the_torch_ops_are_the_dequantized_product_on_the_rounded_activations(k, n, group):
    layer, _ = w4a8(k, n, group)
    x = torch.randn(4, k) * torch.tensor([[1e-3], [1.0], [30.0], [0.0]])
    q, s = quantize_rows(x)
    exact = (q.double() * s.double()) @ layer.weight_fp32().double().t()
    y = int4_int8_products(x, layer.stored(), group)
    magnitude = (q.double().abs() * s.double()) @ layer.weight_fp32().double().abs().t()
    bound = 1e-5 * magnitude + 1e-12
    assert ((y.double() - exact).abs() <= bound).all()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 decoding: the sums stay exact
        assert torch.equal(int4_int8_products(x, layer.stored(), group), y)


@pytest.mark.parametrize("k, n, group, rows", [(64, 13, 32, 1), (768, 2304, 64, 1),
                                               (3072, 768, 128, 3), (256, 40, 256, 17)])
def test_the_kernel_is_the_torch_ops_numbers_at_every_row_count(fresh_build, k, n, group, rows):
    kernel = int4_kernel.int4_rows_kernel()
    layer, _ = w4a8(k, n, group)
    x = torch.randn(rows, k) * torch.logspace(-2, 2, rows)[:, None]
    packed, sz = layer._int4_rows_operands()
    y = kernel(x, packed, sz, n, group)
    assert torch.equal(y, int4_int8_products(x, layer.stored(), group))
    # a row alone is the row in the batch
    assert torch.equal(torch.cat([kernel(x[i:i + 1], packed, sz, n, group) for i in range(rows)]),
                       y)


@pytest.mark.parametrize("flags", [None, *OLDER_CPUS.values()], ids=["native", *OLDER_CPUS])
@pytest.mark.parametrize("nibbles, sign", [(0xFF, 1.0), (0xFF, -1.0), (0x00, 1.0)])
def test_the_largest_sums_stay_exact(fresh_build, tmp_path, flags, nibbles, sign):
    """Every weight 15 (or 0) against activations rounded to ±127 (a constant row), in this CPU's
    build and the older CPUs' (the AVX2 path on any x86 CPU): the AVX2 path's 16-bit pair sums
    reach their bound (4 chunks' 8 pair sums a lane, 8 · 2 · 15 · 127 = 30480 < 2^15) and stay
    exact."""
    kernel = (int4_kernel.int4_rows_kernel() if flags is None
              else built_for(int4_kernel.KERNEL, flags, tmp_path))
    k, n, group = 512, 40, 128
    layer, _ = w4a8(k, n, group)
    layer.qweight.fill_(nibbles)
    x = torch.full((2, k), sign * 0.75)
    packed, sz = layer._int4_rows_operands()
    y = kernel(x, packed, sz, n, group)
    assert torch.equal(y, int4_int8_products(x, layer.stored(), group))


@pytest.mark.parametrize("policy", ["auto", "bf16"])  # bf16 forced, as native-bf16 CPUs run it
def test_decoding_takes_the_kernel_and_keeps_every_token(fresh_build, policy):
    torch.manual_seed(0)
    model = build(tiny(spec="1+1R4+1", vocab_size=512, d_model=64))
    quantized = quantize_model(model, 4, ("prelude", "cores", "coda"), group_size=32,
                               activations="int8")[0]
    device, chosen = decoding.for_decoding(policy, quantized)
    line = chosen.describe()
    plain = copy.deepcopy(quantized)  # the same decoding layout, the torch ops in every layer
    for layer in plain.modules():
        if isinstance(layer, QuantizedLinear):
            layer.row_kernel = None
    layers = [m for m in quantized.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.row_kernel is int4_kernel.int4_rows_kernel() for m in layers)
    assert decoding.INT4_KERNEL_NOTE in line
    prompt, s = [[5, 6, 7, 8]], Sampling(max_new_tokens=12, temperature=0, stop_at_eos=False)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad(), precision.autocast(device, chosen):
        assert torch.equal(quantized(ids).logits, plain(ids).logits)
        assert generate(quantized, prompt, s) == generate(plain, prompt, s)
    if policy == "auto":  # fp32, where greedy output does not depend on batching or speculation
        assert_decodes_exactly(quantized)  # cached, uncached, speculation, batched


def test_without_the_kernel_the_layers_keep_the_torch_ops_and_say_so(fresh_build, native_off):
    model = build(tiny(spec="1+1R2+1", vocab_size=256))
    quantized = quantize_model(model, 4, ("cores",), group_size=32, activations="int8")[0]
    line = decoding.for_decoding("auto", quantized)[1].describe()
    assert (f"{decoding.INT4_KERNEL_MISSING} (turned off by MESHLM_NATIVE=0; unset it to build "
            "the kernel), so int4 x int8 products by torch ops") in line
    assert all(m.row_kernel is None for m in quantized.modules()
               if isinstance(m, QuantizedLinear))


def test_weight_only_int4_gets_no_kernel(fresh_build):
    model = build(tiny(spec="1+1R2+1", vocab_size=256))
    quantized = quantize_model(model, 4, ("cores",), group_size=32)[0]
    assert int4_kernel.give(quantized) == 0 and int4_kernel.unavailable(quantized) is None


def test_a_compiled_step_calls_the_kernel_as_its_operator(fresh_build):
    layer, _ = w4a8(128, 48, 32)
    int4_kernel.give(torch.nn.ModuleList([layer]))
    x = torch.randn(1, 128)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    with torch.no_grad():
        assert torch.equal(compiled(x), layer(x))
    assert torch.equal(layer(x), int4_int8_products(x, layer.stored(), 32) + layer.bias)


def test_w4a8_is_int4_weight_only_to_int8_rounding_of_the_activations():
    layer, linear = w4a8(256, 64, 64)
    weight_only = QuantizedLinear.from_linear(linear, 4, 64)
    x = torch.randn(3, 256)
    reference = F.linear(x, weight_only.weight_fp32(), linear.bias)
    error = (layer(x) - reference).abs().amax() / reference.abs().amax()
    assert error < 0.02  # int8 rows: half a step in 127 per activation


@pytest.mark.parametrize("flags", OLDER_CPUS.values(), ids=OLDER_CPUS.keys())
def test_the_kernel_built_for_older_cpus_gives_the_same_numbers(tmp_path, flags):
    """Built without -march=native: the plain C loop; for this CPU less AVX512: the AVX2 one, as
    on CPUs without AVX512-VNNI (less AVX512_BF16 alone: this CPU's own path again)."""
    assert int4_kernel._same_numbers(built_for(int4_kernel.KERNEL, flags, tmp_path))
