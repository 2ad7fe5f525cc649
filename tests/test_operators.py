"""The C kernels' torch operators implemented in C++ (meshlm.kernels.operators, operators.cpp): once
a process traces a graph through one (kernel.compiled_operators) and where a C++ compiler builds
them, every kernel's meshlm::<name> runs in C++ and gives its product's numbers bit for bit; bad
input is a ValueError naming the problem; a process that does not compile builds nothing; where
they cannot be had the Python implementation serves the same numbers and `unavailable` names
why."""
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import build, tiny
from test_native import fake_compiler

from meshlm.kernels import bf16_rows, fp32_rows, operators
from meshlm.kernels import build as kernel_build
from meshlm.kernels.kernel import compiled_operators
from meshlm.quant import int4_bf16_kernel, int4_kernel, quantize_model, row_kernel
from meshlm.quant.linear import QuantizedLinear, quantize_weight, weight_sums

KERNELS = (fp32_rows.KERNEL, bf16_rows.KERNEL, row_kernel.KERNEL, int4_kernel.KERNEL,
           int4_bf16_kernel.KERNEL)


def products() -> list:
    """Every kernel's product, its operator implemented as a compiled step's would be."""
    found = [kernel.product() for kernel in KERNELS]
    assert all(found), "this machine builds every C kernel (tests/test_native.py and others)"
    compiled_operators()
    return found


def test_with_a_cpp_compiler_every_kernels_operator_runs_in_cpp():
    products()
    expected = "c++" if kernel_build.compiler(cpp=True) else "python"
    assert [kernel.implemented for kernel in KERNELS] == [expected] * len(KERNELS)
    if expected == "python":
        assert "C++ compiler" in operators.unavailable()


def test_each_operator_gives_its_products_numbers_bit_for_bit():
    fp32, bf16, int8, int4, int4_bf16 = products()
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(300, 64, generator=g), torch.randn(300, generator=g)
    blocks, x = fp32_rows.as_blocks(weight, fp32_rows.WIDTH), torch.randn(5, 64, generator=g)
    for b in (bias, None):  # a ragged last block, with and without a bias
        assert torch.equal(torch.ops.meshlm.fp32_rows(x, blocks, b, 300), fp32(x, blocks, b, 300))
    weight = torch.randn(37, 64, generator=g).bfloat16()
    for b in (bias[:37], None):  # fp32 rows, rounded to bf16 by the operator as by the product
        assert torch.equal(torch.ops.meshlm.bf16_rows(x, weight, b), bf16(x, weight, b))
    weight = torch.randint(-127, 128, (40, 200), dtype=torch.int8, generator=g).t()
    x = torch.randn(1, 200, generator=g)
    for sums in (weight_sums(weight), None):  # the layer's sums, or summed here
        assert torch.equal(torch.ops.meshlm.int8_row(x, weight, sums), int8(x, weight))
    layer = QuantizedLinear(256, 37, False, 4, 64, activations="int8")
    for name, value in quantize_weight(torch.randn(37, 256, generator=g), 4, 64).items():
        getattr(layer, name).copy_(value)
    packed, sz = layer._int4_rows_operands()
    x = torch.randn(3, 256, generator=g)
    assert torch.equal(torch.ops.meshlm.int4_rows(x, packed, sz, 37, 64),
                       int4(x, packed, sz, 37, 64))  # 37 of 48 outputs: cut in C++ as in Python
    for rows in (x, x.bfloat16()):  # fp32 rows rounded to bf16 by the operator as by the product
        assert torch.equal(torch.ops.meshlm.int4_bf16_rows(rows, packed, sz, 37, 64),
                           int4_bf16(rows, packed, sz, 37, 64))


@pytest.mark.parametrize("call, named", [
    (lambda: torch.ops.meshlm.bf16_rows(torch.randn(1, 30), torch.randn(4, 30).bfloat16(), None),
     "in_features 30 is not a multiple"),
    (lambda: torch.ops.meshlm.fp32_rows(torch.randn(1, 8), torch.randn(1, 8, 200), None, 200),
     f"blocks 200 wide, at most {fp32_rows.WIDTH}"),
    (lambda: torch.ops.meshlm.int8_row(torch.randn(1, row_kernel.MAX_K + 1),
                                       torch.ones(row_kernel.MAX_K + 1, 2, dtype=torch.int8), None),
     f"{row_kernel.MAX_K + 1} inputs overflow its int32 sums")])
def test_bad_input_to_an_operator_is_a_value_error_naming_it(call, named):
    products()
    if fp32_rows.KERNEL.implemented != "c++":
        pytest.skip("no C++ compiler here: the products' own checks are tested with them")
    with pytest.raises(ValueError, match=named):
        call()


def test_layers_too_wide_for_the_int8_operator_keep_the_torch_ops(monkeypatch):
    """The operator refuses rows over MAX_K inputs (its sums would overflow): such layers are never
    given the kernel."""
    monkeypatch.setattr(row_kernel, "kernel_speedup", lambda kernel: {
        "kernel_over_torch": 2.0, "batch_kernel_over_torch": 2.0})
    quantized = quantize_model(build(tiny(spec="1+1R2+1", vocab_size=256)), 8, ("cores",),
                               activations="int8")[0]
    widths = {m.in_features for m in quantized.modules() if isinstance(m, QuantizedLinear)}
    monkeypatch.setattr(row_kernel, "MAX_K", min(widths))  # the wider layers are too wide now
    given = row_kernel.give_row_kernel(quantized)
    layers = [m for m in quantized.modules() if isinstance(m, QuantizedLinear)]
    if given:  # where this machine gives the kernel at all (exact torch._int_mm)
        assert all((m.row_kernel is not None) == (m.in_features == min(widths)) for m in layers)
        assert 0 < given < len(layers)


def test_an_unknown_operator_is_refused_with_its_reason():
    products()
    if not kernel_build.compiler(cpp=True):
        pytest.skip("no C++ compiler here: nothing to register")
    function = kernel_build.library(fp32_rows.KERNEL.source).fp32_rows_product
    assert not operators.register("no_such_kernel", function)
    assert "no operator meshlm::no_such_kernel" in operators.unavailable()
    assert operators.register("fp32_rows", function) and operators.unavailable() is None


CHILD = """import json, sys, torch
from meshlm.kernels import operators
from meshlm.quant import int4_kernel
from meshlm.quant.linear import QuantizedLinear, quantize_weight
product = int4_kernel.int4_rows_kernel()
layer = QuantizedLinear(64, 16, False, 4, 32, activations="int8")
for name, value in quantize_weight(torch.randn(16, 64), 4, 32).items():
    getattr(layer, name).copy_(value)
packed, sz = layer._int4_rows_operands()
x = torch.randn(2, 64)
same = lambda: torch.equal(torch.ops.meshlm.int4_rows(x, packed, sz, 16, 32),
                           product(x, packed, sz, 16, 32))
eager = {"implemented": int4_kernel.KERNEL.implemented, "same": same(),
         "built": sorted(p.name.split("-")[0] for p in (operators.build.cache_dir() /
                                                      "kernels").glob("*.so"))}
traced = torch.compile(lambda x: torch.ops.meshlm.int4_rows(x, packed, sz, 16, 32), backend="eager")
assert torch.equal(traced(x), product(x, packed, sz, 16, 32))  # the first trace implements it
print(json.dumps({"eager": eager, "implemented": int4_kernel.KERNEL.implemented,
                  "why": operators.unavailable(), "same": same()}))
"""


def child(tmp_path, **env) -> dict:
    """CHILD's report, run in a fresh process (one loads operators.cpp once) with a cache of its
    own."""
    env = {**os.environ, "MESHLM_CACHE": str(tmp_path / "cache"), **env}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("cxx", ["found", "failing"])
def test_only_a_process_that_compiles_builds_the_operators(tmp_path, cxx):
    """Eager decoding calls the kernels by ctypes: operators.cpp is built (~5 s) only once a graph
    is traced through a kernel's operator; where $CXX fails to build it, the operators stay in
    Python (the same numbers) and unavailable() names why."""
    if cxx == "failing":
        (tmp_path / "bin").mkdir()
        report = child(tmp_path, CXX=fake_compiler(tmp_path / "bin", 1))
    elif kernel_build.compiler(cpp=True):
        report = child(tmp_path)
    else:
        pytest.skip("no C++ compiler here: the failing case is the one to test")
    assert report["eager"] == {"implemented": "python", "same": True, "built": ["int4_rows"]}
    if cxx == "found":
        assert report == {**report, "implemented": "c++", "why": None, "same": True}
    else:
        assert report == {**report, "implemented": "python", "same": True, "why": (
            f"{tmp_path / 'bin' / 'cc'} failed to build operators.cpp (exit status 1); set $CXX "
            "to a C++ compiler that builds it (g++ or clang++)")}
