"""The one-row int8-activation product compiled on this machine (meshlm.quant.row_kernel): the row
rounded as quantize_rows rounds it, the exact integer sums, the same scaling, so the same numbers
as the torch ops bit for bit and decoding through it changes no output; built once per machine
and CPU, atomically, loaded only when private; used where its probe found it faster; where it
cannot be built (its source missing from the install, no compiler, a failing build,
MESHLM_NATIVE=0) the layers keep PyTorch's ops and the precision line says why."""
import copy
import os
import stat

import pytest
import torch
from conftest import OLDER_CPUS, build, built_for, forget_kernels, tiny
from test_quant import assert_decodes_exactly

from meshlm import decoding
from meshlm.generate import Sampling, generate
from meshlm.kernels.kernel import MIN_SPEEDUP
from meshlm.model.kv_cache import KVCache
from meshlm.quant import QuantizedLinear, quantize_model, row_kernel
from meshlm.quant import linear as linear_module
from meshlm.quant.linear import exact_int8_products, quantize_rows, scaled_int8_products


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A cache of its own and no kernel remembered from earlier in this process; after, none
    remembered from it (forget_kernels: a test here may leave every kernel unbuildable)."""
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path))
    row_kernel.int8_row_kernel.cache_clear()
    yield tmp_path / "kernels"
    forget_kernels()


CASES = [(1, 1, 1.0), (37, 200, 1e-3), (2304, 768, 1.0), (50, 3072, 80.0), (8, 64, 0.0)]


@pytest.mark.parametrize("n, k, size", CASES)
def test_the_compiled_product_is_the_torch_ops_numbers_bit_for_bit(fresh_build, n, k, size):
    kernel = row_kernel.int8_row_kernel()
    assert kernel is not None, "this machine has a C compiler (cc or gcc): the kernel builds"
    assert_exact_sums(kernel, n, k, size)
    assert [p.name for p in fresh_build.iterdir()] == [p.name for p in fresh_build.glob("*.so")]


@pytest.mark.parametrize("flags", OLDER_CPUS.values(), ids=OLDER_CPUS.keys())
def test_the_kernel_built_for_older_cpus_sums_exactly(tmp_path, flags):
    """The paths this CPU may not run (conftest.OLDER_CPUS: the plain loop; AVX2 without an int8
    dot-product instruction, where vpmaddubsw multiplies |w| by q with w's sign) give the exact
    sums, the weight -128 included, each row alone what it gives in a batch."""
    product = built_for(row_kernel.KERNEL, flags, tmp_path)
    assert row_kernel.KERNEL.check(product)
    for case in CASES:
        assert_exact_sums(product, *case)


def assert_exact_sums(kernel, n: int, k: int, size: float) -> None:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(1, k, generator=g) * size
    x[0, 0] = size * 3  # a large entry, so most of the row rounds to small integers
    if size == 1.0 and k >= 8:  # max 127: the scale is 1.0 exactly, and x/s = 2.5 … are ties
        x[0, :8] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5])
        assert quantize_rows(x)[1].item() == 1.0
    weight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    q, scale = quantize_rows(x)
    exact = (q.long() @ weight.long().t()).float() * scale  # exact integer sums, then the scale
    assert torch.equal(kernel(x, weight.t()), exact)
    if exact_int8_products():
        assert torch.equal(kernel(x, weight.t()), scaled_int8_products(x, weight.t()))


def without_exact_int_mm(monkeypatch) -> None:
    """As on a CPU without int8 dot-product instructions, whose torch._int_mm saturates."""
    for module in (linear_module, row_kernel, decoding):
        monkeypatch.setattr(module, "exact_int8_products", lambda: False)


@pytest.mark.parametrize("int_mm", ["this CPU's", "this CPU's, faster at a batch", "inexact"])
def test_decoding_through_the_kernel_gives_the_same_numbers(fresh_build, monkeypatch, int_mm):
    """Where torch._int_mm's sums are exact the kernel takes one row and _int_mm the others, or
    every row where its probe found it faster at a batch too; where they are not (forced: a CPU
    without VNNI) it takes every row, so a row's numbers still do not depend on the batch, and
    they are the exact sums' either way."""
    exact = exact_int8_products()  # this CPU's, for the layers without the kernel below
    # whether this CPU's probe finds it faster is the next tests' matter: here it is used
    batch = 0.5 if int_mm == "this CPU's" else 2.0
    monkeypatch.setattr(row_kernel, "_probe", lambda kernel: {
        "kernel_over_torch": 2.0, "batch_kernel_over_torch": batch})
    if int_mm == "inexact":
        without_exact_int_mm(monkeypatch)
    model = build(tiny(spec="1+1R3+1", vocab_size=512, d_model=64))
    quantized = quantize_model(model, 8, ("prelude", "cores", "coda"), activations="int8")[0]
    _, chosen = decoding.for_decoding("auto", quantized)
    plain = copy.deepcopy(quantized)  # the same decoding layout, torch._int_mm at every row
    for layer in plain.modules():
        if isinstance(layer, QuantizedLinear):
            layer.row_kernel = None
    layers = [m for m in quantized.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.row_kernel is row_kernel.int8_row_kernel() for m in layers)
    every = int_mm != "this CPU's" or not exact
    assert all(m.kernel_every_row == every for m in layers)
    assert (decoding.ROWS_KERNEL_NOTE if every else decoding.ROW_KERNEL_NOTE) in chosen.reason
    if every:
        assert (decoding.ROWS_FASTER if exact and int_mm != "inexact" else
                decoding.ROWS_INEXACT) in chosen.reason
    assert_decodes_exactly(quantized)  # cached, uncached, speculation, batched
    s = Sampling(max_new_tokens=10, temperature=0, stop_at_eos=False)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    ours = [generate(quantized, [p], s)[0] for p in prompts]
    if not exact:  # this CPU's torch._int_mm saturates: no exact torch path to compare with
        return
    monkeypatch.setattr(linear_module, "exact_int8_products", lambda: True)  # plain: _int_mm
    assert ours == [generate(plain, [p], s)[0] for p in prompts]
    if int_mm == "inexact":
        return
    ids, step = torch.tensor([[5, 6, 7]]), torch.tensor([[9]])
    caches = KVCache(), KVCache()
    with torch.no_grad():  # one token after a cached past: one row per layer, the kernel's case
        for model_, cache in zip((quantized, plain), caches):
            model_(ids, cache=cache)
        calls = []
        for layer in layers:  # count the kernel's calls in this step
            layer.row_kernel = lambda *args, kernel=layer.row_kernel: calls.append(args) or \
                kernel(*args)
        assert torch.equal(quantized(step, cache=caches[0]).logits,
                           plain(step, cache=caches[1]).logits)
        # every quantized layer once per visit: the core's three loop passes, prelude and coda one
        assert len(calls) == sum(3 if name.startswith("cores.") else 1 for name, m in
                                 quantized.named_modules() if isinstance(m, QuantizedLinear))
        # each with the layer's own weight sums, taken once (not summed again by every call)
        assert all(torch.equal(sums, weight.sum(0, dtype=torch.int32)) for _, weight, sums in calls)
        calls.clear()  # three rows (a prompt) go through the kernel only where it takes every row
        assert torch.equal(quantized(ids).logits, plain(ids).logits)
        assert bool(calls) == every and all(x.shape[0] == 3 for x, _, _ in calls)


def fake_compiler(folder, exit_code: int) -> str:
    path = folder / "cc"
    path.write_text(f"#!/bin/sh\necho fake cc 1.0\nexit {exit_code}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.parametrize("how, named", [
    ("no compiler", "no C compiler on PATH"),
    ("a failing build", "cc failed to build int8_rows.c (exit status 1); set $CC"),
    ("MESHLM_NATIVE=0", "turned off by MESHLM_NATIVE=0"),
    ("a source missing from the install", "its source int8_rows.c is missing from the install")])
def test_without_the_kernel_the_layers_keep_torchs(fresh_build, monkeypatch, tmp_path, how,
                                                   named):
    if how == "a source missing from the install":
        monkeypatch.setattr(row_kernel.KERNEL, "source", tmp_path / "install" / "int8_rows.c")
    elif how == "no compiler":
        monkeypatch.delenv("CC", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    elif how == "a failing build":
        (tmp_path / "bin").mkdir()
        monkeypatch.setenv("CC", fake_compiler(tmp_path / "bin", 1))
    else:
        monkeypatch.setenv("MESHLM_NATIVE", "0")
    assert row_kernel.int8_row_kernel() is None
    model = build(tiny(spec="1+1R3+1", vocab_size=256))
    quantized = quantize_model(model, 8, ("cores",), activations="int8")[0]
    _, chosen = decoding.for_decoding("auto", quantized)
    assert decoding.ROW_KERNEL_NOTE not in chosen.reason
    fallback = "one-token int8 products by torch._int_mm" if exact_int8_products() else \
        "int8 products by torch's weight-only kernel"
    # the kernel would have been used: its absence is named, never silent
    assert f"{decoding.ROW_KERNEL_MISSING} ({row_kernel.unavailable(quantized)}), so " \
        f"{fallback}" in chosen.reason
    assert named in row_kernel.unavailable(quantized)
    assert all(m.row_kernel is None for m in quantized.modules()
               if isinstance(m, QuantizedLinear))
    assert_decodes_exactly(quantized)
    # a failed build leaves nothing behind, not even its temp file (the other kernels, which
    # decoding asked for too, may have built where only this one's source is missing)
    left = list(fresh_build.iterdir()) if fresh_build.exists() else []
    assert not [p for p in left if p.name.startswith("int8_rows") or p.suffix == ".tmp"]


def test_the_library_is_built_once_and_reused(fresh_build):
    assert row_kernel.int8_row_kernel() is not None
    (library,) = fresh_build.glob("int8_rows-*.so")
    built = library.stat().st_mtime_ns
    row_kernel.int8_row_kernel.cache_clear()  # a new process
    assert row_kernel.int8_row_kernel() is not None
    assert list(fresh_build.glob("int8_rows-*.so")) == [library]
    assert library.stat().st_mtime_ns == built


def test_a_kernel_is_keyed_by_the_headers_it_includes(fresh_build, tmp_path):
    """A source including a header of its folder (as the row kernels include rows.h): editing
    the header builds a new library with it; a header missing from the install is named."""
    from meshlm.kernels import build as kernel_build

    folder = tmp_path / "sources"
    folder.mkdir()
    source, header = folder / "answer.c", folder / "value.h"
    # an include in a comment is none: no such header is needed
    source.write_text('#include "value.h"\n/* as in\n#include "example.h"\n */\n'
                      '// #include "other.h"\nint answer(void) { return VALUE; }\n')
    answers = []
    for value in (41, 42):
        header.write_text(f"#define VALUE {value}\n")
        library = kernel_build.library(source)
        assert library is not None, kernel_build.why_not(source)
        answers.append(library.answer())
    assert answers == [41, 42] and len(list(fresh_build.glob("answer-*.so"))) == 2
    header.unlink()
    assert kernel_build.library(source) is None
    assert kernel_build.why_not(source).startswith("its header value.h, which answer.c includes, "
                                                   "is missing from the install")


def test_weight_only_layers_get_no_kernel(fresh_build):
    model = build(tiny(spec="1+1R2+1", vocab_size=256))
    quantized = quantize_model(model, 8, ("cores",), activations="bf16")[0]
    assert row_kernel.give_row_kernel(quantized) == 0
    assert row_kernel.unavailable(quantized) is None  # nothing to name: no layer would take it
    assert os.environ["MESHLM_CACHE"] == str(fresh_build.parent)


@pytest.mark.parametrize("int_mm, speedup, batch, used", [
    ("this CPU's", 1.4, 1.2, True), ("this CPU's", 1.4, 0.8, True),
    ("this CPU's", 0.9, 1.2, False), ("inexact", 1.4, 1.2, True), ("inexact", 1.4, 0.8, False),
    ("inexact", 0.9, 1.2, False)])
def test_layers_get_the_kernel_only_where_this_machines_probe_found_it_faster(
        fresh_build, monkeypatch, int_mm, speedup, batch, used):
    """Measured once per machine (cached with its figures in machine.json), as the split layout;
    where torch._int_mm is not exact the kernel takes every row, so it must not lose much at a
    served batch's rows either; where they are, it takes every row where it was faster at a
    served batch's rows too, else one."""
    if int_mm == "inexact":
        without_exact_int_mm(monkeypatch)
    probes = []
    figures = {"kernel_over_torch": speedup, "batch_kernel_over_torch": batch}
    monkeypatch.setattr(row_kernel, "_probe",
                        lambda kernel: probes.append(row_kernel.exact_int8_products()) or figures)
    for _ in range(2):
        quantized = quantize_model(build(tiny(spec="1+1R2+1", vocab_size=256)), 8, ("cores",),
                                   activations="int8")[0]
        assert (row_kernel.give_row_kernel(quantized) > 0) == used
        every = not row_kernel.exact_int8_products() or batch >= MIN_SPEEDUP
        assert row_kernel.every_row(quantized) == (used and every)
    assert probes == [row_kernel.exact_int8_products()]
    assert "int8-row-kernel" in (fresh_build.parent / "machine.json").read_text()


@pytest.mark.parametrize("exact", [True, False])
def test_the_probe_times_the_layers_with_and_without_the_kernel(fresh_build, monkeypatch, exact):
    """One row and a served batch's rows, each through the kernel and through the layers' other
    path (torch._int_mm, or the weight-only kernel where _int_mm is not exact)."""
    monkeypatch.setattr(row_kernel, "PROBE_MB", 2)  # a quick race: the figures' shape
    if not exact:
        without_exact_int_mm(monkeypatch)
    product, rows = row_kernel.int8_row_kernel(), []
    figures = row_kernel._probe(lambda x, *args: rows.append(len(x)) or product(x, *args), reps=1)
    for prefix in ("", "batch_"):
        assert figures[f"{prefix}torch_ms"] > 0 and figures[f"{prefix}kernel_ms"] > 0
        assert figures[f"{prefix}kernel_over_torch"] == pytest.approx(
            figures[f"{prefix}torch_ms"] / figures[f"{prefix}kernel_ms"])
    assert set(rows) == {1, row_kernel.BATCH_ROWS}  # the kernel's pass takes the batch too


@pytest.mark.parametrize("opened_up", ["file", "folder"])
def test_a_library_others_could_have_replaced_is_not_loaded(fresh_build, opened_up):
    """$MESHLM_CACHE may be shared: a group- or world-writable library (or folder) is not run."""
    assert row_kernel.int8_row_kernel() is not None
    (library,) = fresh_build.glob("int8_rows-*.so")
    target = library if opened_up == "file" else fresh_build
    target.chmod(target.stat().st_mode | stat.S_IWOTH)
    row_kernel.int8_row_kernel.cache_clear()
    assert row_kernel.int8_row_kernel() is None
    target.chmod(target.stat().st_mode & ~stat.S_IWOTH)
    row_kernel.int8_row_kernel.cache_clear()
    assert row_kernel.int8_row_kernel() is not None


def test_rows_too_wide_for_int32_sums_take_the_torch_ops(fresh_build, monkeypatch):
    """int8_rows.c sums (q + 128)·w in int32: exact up to MAX_K inputs; wider rows are not sent."""
    kernel = row_kernel.int8_row_kernel()
    assert row_kernel.MAX_K * 255 * 128 <= 2**31 - 1 < (row_kernel.MAX_K + 1) * 255 * 128
    monkeypatch.setattr(row_kernel, "MAX_K", 100)
    calls = []
    monkeypatch.setattr(row_kernel, "scaled_int8_products",
                        lambda x, w: calls.append(x.shape) or scaled_int8_products(x, w))
    g = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (16, 200), dtype=torch.int8, generator=g)
    x = torch.randn(1, 200, generator=g)
    y = kernel(x, weight.t())
    assert calls == [(1, 200)] and torch.equal(y, scaled_int8_products(x, weight.t()))
    if exact_int8_products():  # exact sums only where torch._int_mm has them (VNNI, AMX)
        q, scale = quantize_rows(x)
        assert torch.equal(y, (q.long() @ weight.long().t()).float() * scale)
