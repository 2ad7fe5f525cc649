"""bf16 decoding's compiled kernel (meshlm.kernels.bf16_rows): F.linear's product to rounding over
the same bf16 numbers, each row the same bits whatever else the call holds; Bf16Linear takes it up
to KERNEL_ROWS rows on the nn.Linear's own weight and F.linear beyond; decoding in bf16 through it
gives the logits F.linear gives to bf16 rounding; used only where its probe found it faster; where
it cannot be had the precision line says why."""
import copy

import pytest
import torch
from conftest import OLDER_CPUS, build, built_for, fresh_kernel, tiny

from meshlm import decoding
from meshlm.generate import Sampling, generate
from meshlm.kernels import bf16_rows
from meshlm.kernels.fp32_rows import rows_apart
from meshlm.kernels.kernel import close_to_float64
from meshlm.runtime import bf16_linear, precision
from meshlm.runtime.bf16_linear import KERNEL_ROWS, Bf16Linear

CPU = torch.device("cpu")
BF16 = precision.Precision(torch.bfloat16, "as requested")


@pytest.fixture
def kernel(monkeypatch, tmp_path):
    """The kernel built into a cache of its own, none remembered from earlier in this process."""
    with fresh_kernel(bf16_rows.KERNEL, monkeypatch, tmp_path) as built:
        yield built


def paid(monkeypatch, speedup: float, batch: float = 0.5) -> None:
    """The probe's figures, as if measured: at one row and at bf16_linear.BATCH_ROWS."""
    monkeypatch.setattr(bf16_linear, "kernel_speedup", lambda kernel: {
        "kernel_over_linear": speedup, "batch_kernel_over_linear": batch})


@pytest.mark.parametrize("out_features, in_features",  # 39, 37: rows no tile takes (n % 4)
                         [(256, 768), (300, 64), (5, 32), (37, 96), (39, 96)])
@pytest.mark.parametrize("bias", [True, False])
def test_the_kernel_is_f_linear_to_rounding_and_each_row_its_own(kernel, out_features,
                                                                  in_features, bias):
    g = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g) if bias else None
    x = torch.randn(7, in_features, generator=g).bfloat16()  # a full tile of rows and a ragged one
    y = kernel(x, weight, b)
    exact = x.double() @ weight.double().t() + (0 if b is None else b.double())
    bound = 1e-5 * (x.abs().double() @ weight.abs().double().t()) + 1e-6
    assert y.dtype == torch.float32 and ((y.double() - exact).abs() <= bound).all()
    assert rows_apart(lambda rows: kernel(rows, weight, b), x)


def test_a_width_the_kernel_does_not_take_is_refused_and_left_to_f_linear(kernel):
    with pytest.raises(ValueError, match="not a multiple of 32"):
        kernel(torch.ones(1, 48, dtype=torch.bfloat16), torch.ones(4, 48, dtype=torch.bfloat16),
               None)
    model = torch.nn.Sequential(torch.nn.Linear(48, 8), torch.nn.Linear(8 * 4, 8)).bfloat16()
    assert [bf16_linear.takes(m) for m in model] == [False, True]


def test_short_calls_take_the_kernel_and_longer_ones_f_linear_on_the_same_weight(kernel):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96).bfloat16()
    layer = Bf16Linear(linear, kernel)
    assert layer.weight is linear.weight and layer.bias is linear.bias
    assert list(layer.state_dict()) == ["weight", "bias"]  # saved as the nn.Linear it replaces
    calls = []
    layer.kernel = lambda *args: calls.append(len(args[0])) or kernel(*args)
    with torch.no_grad(), precision.autocast(CPU, BF16):
        for rows in range(1, KERNEL_ROWS + 3):
            x = torch.randn(rows, 64)
            y = layer(x)
            assert y.dtype == torch.bfloat16 and y.shape == (rows, 96)
            torch.testing.assert_close(y.float(), linear(x).float(), rtol=1e-2, atol=1e-2)
        layer(torch.randn(2, 1, 64))  # (B, T, d) as decoding calls it
    assert calls == [*range(1, KERNEL_ROWS + 1), 2]
    calls.clear()  # where the probe found the kernel faster at a batch too: every row count
    layer = Bf16Linear(linear, kernel, every_row=True)
    layer.kernel = lambda *args: calls.append(len(args[0])) or kernel(*args)
    with torch.no_grad(), precision.autocast(CPU, BF16):
        for rows in (1, KERNEL_ROWS + 1, 40):
            torch.testing.assert_close(layer(torch.ones(rows, 64)).float(),
                                       linear(torch.ones(rows, 64).bfloat16()).float(),
                                       rtol=1e-2, atol=1e-2)
    assert calls == [1, KERNEL_ROWS + 1, 40] and "every row" in layer.extra_repr()


def test_an_input_that_needs_grad_takes_f_linear(kernel):
    layer = Bf16Linear(torch.nn.Linear(32, 8).bfloat16(), kernel)
    layer.kernel = None  # a call through it would fail
    x = torch.randn(1, 32, dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None


def decoded(model, prompts, cache=True):
    s = Sampling(max_new_tokens=6, temperature=0, stop_at_eos=False)
    with torch.no_grad(), precision.autocast(CPU, BF16):
        logits = []
        generate(model, prompts, s, cache=cache,
                 observe=lambda out, mask: logits.append(out.logits[:, -1].float()))
    return logits


@pytest.mark.parametrize("scheme", ["mesh", "base"])
def test_bf16_decoding_through_the_kernel_gives_f_linears_logits_to_bf16_rounding(kernel,
                                                                                  monkeypatch,
                                                                                  scheme):
    model = build(tiny(scheme=scheme, spec="1+1R2+1", d_model=64, vocab_size=256))
    paid(monkeypatch, 2.0)
    with_kernel, plain = copy.deepcopy(model), copy.deepcopy(model)
    _, chosen = decoding.for_decoding("bf16", with_kernel)
    precision.store_weights(plain, BF16)
    swapped = [m for m in with_kernel.modules() if isinstance(m, Bf16Linear)]
    assert len(swapped) == sum(type(m) is torch.nn.Linear for m in plain.modules()) > 0
    assert decoding.BF16_KERNEL_NOTE in chosen.reason and "2.0x F.linear" in chosen.reason
    prompts = [[5, 6, 7], [9, 10, 11]]
    for ours, theirs in zip(decoded(with_kernel, prompts), decoded(plain, prompts)):
        torch.testing.assert_close(ours, theirs, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("speedup, batch, used, every", [
    (2.0, 0.5, True, False), (2.0, 3.0, True, True), (1.0, 3.0, False, False)])
def test_the_kernel_is_used_only_where_its_probe_found_it_faster(kernel, monkeypatch, speedup,
                                                                 batch, used, every):
    """At up to KERNEL_ROWS rows where it was faster at one row, at every row count where it was
    faster at BATCH_ROWS too (a CPU without bf16 arithmetic, whose F.linear has no blocked
    kernel)."""
    paid(monkeypatch, speedup, batch)
    model = build(tiny(d_model=64))
    _, chosen = decoding.for_decoding("bf16", model)
    layers = [m for m in model.modules() if isinstance(m, Bf16Linear)]
    assert bool(layers) == used and bf16_linear.every_row(model) == every
    assert all(m.every_row == every for m in layers)
    assert (decoding.BF16_KERNEL_NOTE in chosen.reason) == (used and not every)
    assert (decoding.BF16_ROWS_KERNEL_NOTE in chosen.reason) == every
    fp32 = build(tiny(d_model=64))
    decoding.for_decoding("auto", fp32)  # fp32 decoding never takes it
    assert not any(isinstance(m, Bf16Linear) for m in fp32.modules())


def test_the_probe_times_both_and_is_cached(kernel, tmp_path):
    first = bf16_linear.kernel_speedup(kernel)
    for prefix in ("", "batch_"):  # one row, and bf16_linear.BATCH_ROWS
        assert first[f"{prefix}kernel_ms"] > 0 and first[f"{prefix}linear_ms"] > 0
        assert first[f"{prefix}kernel_over_linear"] == pytest.approx(
            first[f"{prefix}linear_ms"] / first[f"{prefix}kernel_ms"])
    assert "bf16-rows-kernel" in (tmp_path / "machine.json").read_text()
    assert bf16_linear.kernel_speedup(kernel) == first  # measured once, then read


def test_a_kernel_that_cannot_be_had_is_named_on_the_precision_line(monkeypatch, tmp_path):
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path))
    monkeypatch.setattr(bf16_rows.KERNEL, "source", tmp_path / "install" / "bf16_rows.c")
    bf16_rows.bf16_rows_kernel.cache_clear()
    try:
        model = build(tiny(d_model=64))
        _, chosen = decoding.for_decoding("bf16", model)
        assert (f"{decoding.BF16_KERNEL_MISSING} (its source bf16_rows.c is missing from the "
                f"install ({tmp_path / 'install'}); reinstall meshlm from a wheel or sdist that "
                "ships it), so linear layers keep F.linear") in chosen.reason
        assert "\n" not in chosen.describe()
        assert not any(isinstance(m, Bf16Linear) for m in model.modules())
        assert {m.weight.dtype for m in model.modules() if type(m) is torch.nn.Linear} == \
            {torch.bfloat16}
    finally:
        bf16_rows.bf16_rows_kernel.cache_clear()



def test_the_probe_is_measured_again_when_the_kernel_source_changes(kernel, tmp_path,
                                                                    monkeypatch):
    source = tmp_path / "bf16_rows.c"
    source.write_text(bf16_rows.KERNEL.source.read_text())
    monkeypatch.setattr(bf16_rows.KERNEL, "source", source)
    calls = []
    monkeypatch.setattr(bf16_linear, "_probe", lambda k: calls.append(1) or {"n": len(calls)})
    first = bf16_linear.kernel_speedup(kernel)
    assert bf16_linear.kernel_speedup(kernel) == first == {"n": 1}  # cached
    source.write_text(source.read_text() + "\n/* a new version */\n")
    assert bf16_linear.kernel_speedup(kernel) == {"n": 2} and len(calls) == 2


@pytest.mark.parametrize("flags", OLDER_CPUS.values(), ids=OLDER_CPUS.keys())
def test_the_kernel_built_for_older_cpus_passes_its_check(tmp_path, flags):
    """The paths this CPU does not run (conftest.OLDER_CPUS: the plain loop, AVX512 without
    vdpbf16ps, AVX2) give F.linear's product to fp32 rounding, each row alone what it gives in a
    batch, at every row count up to a tile and past it."""
    product = built_for(bf16_rows.KERNEL, flags, tmp_path)
    assert bf16_rows.KERNEL.check(product)
    weight = torch.randn(40, 96).bfloat16()
    x = torch.randn(7, 96).bfloat16()
    assert close_to_float64(product(x, weight, None), x, weight, None)
    for rows in range(1, 8):
        assert rows_apart(lambda r: product(r, weight, None), x[:rows])
