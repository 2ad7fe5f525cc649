"""fp32 decoding's compiled kernel (meshlm.kernels.fp32_rows): F.linear's product to rounding on
full, padded and narrow blocks, each row the same bits whatever else the call holds; SplitLinear
takes it up to KERNEL_ROWS rows and bmm beyond; decoding through it makes the same tokens cached,
uncached, batched and under speculation; used only where its probe found it faster; where it
cannot be had (a source missing from the install, a failing compiler...) the precision line says
why."""
import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import build, forget_kernels, fresh_kernel, tiny
from test_quant import assert_decodes_exactly

from meshlm import decoding
from meshlm.checkpoint import save_model
from meshlm.cli import main
from meshlm.generate import Sampling, generate
from meshlm.kernels import fp32_rows
from meshlm.model.memory import Router
from meshlm.model.moe import ExpertRouter
from meshlm.runtime import split_linear
from meshlm.runtime.split_linear import KERNEL_ROWS, KERNEL_WIDTH, SplitLinear


@pytest.fixture
def kernel(monkeypatch, tmp_path):
    """The kernel built into a cache of its own, none remembered from earlier in this process."""
    with fresh_kernel(fp32_rows.KERNEL, monkeypatch, tmp_path) as built:
        yield built


def paid(monkeypatch, speedup: float) -> None:
    """The probe's figures, as if measured: the kernel `speedup` times split's and F.linear's."""
    monkeypatch.setattr(split_linear, "kernel_speedup", lambda kernel: {
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
    _, chosen = decoding.for_decoding("auto", with_kernel)
    assert decoding.FP32_KERNEL_NOTE in chosen.reason
    paid(monkeypatch, 0.5)
    monkeypatch.setattr(split_linear, "split_speedup", lambda: 2.0)
    plain = copy.deepcopy(model)
    _, chosen = decoding.for_decoding("auto", plain)
    assert decoding.FP32_KERNEL_NOTE not in chosen.reason
    assert decoding.SPLIT_NOTE in chosen.reason
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


@pytest.mark.parametrize("cfg", [
    tiny(spec="1+1R2+1", vocab_size=256, d_model=64),
    tiny(spec="1+1R2+1", backbone="olmoe", scheme="mesh", n_kv_heads=2, n_experts=4, top_k=2,
         mlp_hidden=16, vocab_size=256, d_model=64),
    tiny(spec="1+2R2+1", backbone="llama", scheme="anchor", tie_embeddings=True, vocab_size=256,
         d_model=64)], ids=["mesh", "olmoe-mesh", "llama-tied"])
def test_every_linear_layer_a_decoded_row_passes_through_gives_it_its_own_bits(kernel,
                                                                              monkeypatch, cfg):
    """Every nn.Linear of the model's layers, MeSH's and MoE's routers included, computes through
    the kernel, and each gives a row alone the bits it gives that row in the batch: by the
    kernel's construction, so on every CPU. (Outside it, documented: a tied head's
    SharedSplitLinear, OLMoE's experts, which are not Linears, and per-loop LoRA's layers, which
    decoding does not lay out, keep torch's ops.)"""
    with_kernel, _ = decoding_pair(monkeypatch, build(cfg))
    assert not any(type(m) is torch.nn.Linear for m in with_kernel.modules())
    routers = [m for m in with_kernel.modules() if isinstance(m, torch.nn.Linear)]
    assert all(m.product.kernel is kernel for m in routers)
    assert any(isinstance(m, Router) for m in routers) == (cfg.scheme == "mesh")
    assert any(isinstance(m, ExpertRouter) for m in routers) == (cfg.backbone == "olmoe")
    calls = []
    for layer in with_kernel.modules():
        if isinstance(layer, SplitLinear):
            assert layer.kernel is kernel
            layer.register_forward_hook(lambda layer, args, y: calls.append((layer, args[0], y)))
    with torch.no_grad():
        with_kernel(torch.randint(2, 256, (5, 1), generator=torch.Generator().manual_seed(0)))
        assert {id(layer) for layer, _, _ in calls} == {
            id(m) for m in with_kernel.modules() if isinstance(m, SplitLinear)}
        for layer, x, y in list(calls):
            assert fp32_rows.rows_apart(layer, x) and torch.equal(layer(x), y)


def torch_keeps_rows_apart(model, rows: int) -> bool:
    """Whether the ops outside the kernel that sum over several numbers for a decoded row (layer
    norm, attention over its one position, the routers' softmax, MeSH's read: batched matmuls of
    the routing weights over the coefficients and of the mix over the values) give each of `rows`
    rows its own bits here. Those are torch's kernels and the BLAS's, not meshlm's: they did on an
    Intel Xeon with AMX (where F.linear does not) and on Zen 5, but nothing promises it."""
    cfg, g = model.config, torch.Generator().manual_seed(0)
    d, heads, slots = cfg.d_model, cfg.n_heads, model.scheme.slots

    def draw(*shape):
        return torch.randn(rows, *shape, generator=g)

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    apart = [fp32_rows.rows_apart(model.final_layer_norm, draw(1, d)),
             fp32_rows.rows_apart(attention, *(draw(heads, 1, d // heads) for _ in range(3))),
             fp32_rows.rows_apart(lambda logits: logits.softmax(-1), draw(1, 2, slots))]
    for values in range(1, cfg.layout.n_steps + 3):  # e, p and one per loop step
        apart += [fp32_rows.rows_apart(torch.matmul, draw(1, 1, slots), draw(1, slots, values)),
                  fp32_rows.rows_apart(torch.matmul, draw(1, 1, values), draw(1, values, d))]
    return all(apart)


def test_a_row_decodes_the_same_logits_alone_and_in_a_batch(kernel, monkeypatch):
    """Bit for bit where torch's ops outside the kernel keep rows apart on this machine (checked
    now, torch_keeps_rows_apart), else to fp32 rounding. Every linear layer on the way is the
    kernel's (the test above, on every CPU): before MeSH's routers were, F.linear's one-row and
    many-row kernels (oneDNN on an Intel Xeon with AMX) made a batched row's logits differ from
    its logits alone in the last bits."""
    torch.manual_seed(0)
    model = build(tiny(spec="1+1R2+1", vocab_size=256, d_model=64)).eval()
    with_kernel, _ = decoding_pair(monkeypatch, model)
    ids = torch.randint(2, 256, (3, 1))
    exact = torch_keeps_rows_apart(with_kernel, len(ids))
    with torch.no_grad():
        batched = with_kernel(ids).logits
        for row in range(3):
            alone = with_kernel(ids[row:row + 1]).logits[0]
            if exact:
                assert torch.equal(alone, batched[row])
            else:
                torch.testing.assert_close(alone, batched[row], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("speedup, used", [(2.0, True), (1.0, False)])
def test_the_kernel_is_used_only_where_its_probe_found_it_faster(kernel, monkeypatch, speedup,
                                                                 used):
    paid(monkeypatch, speedup)
    assert (split_linear.paying_kernel() is kernel) == used


def test_the_probe_times_all_three_and_is_cached(kernel, tmp_path):
    first = split_linear.kernel_speedup(kernel)
    assert first["kernel_ms"] > 0 and first["split_ms"] > 0 and first["linear_ms"] > 0
    assert first["kernel_over_split"] == pytest.approx(first["split_ms"] / first["kernel_ms"])
    assert "fp32-rows-kernel" in (tmp_path / "machine.json").read_text()
    assert split_linear.kernel_speedup(kernel) == first  # measured once, then read


def test_without_the_kernel_decoding_keeps_torchs_ops(monkeypatch, tmp_path, native_off):
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path))
    assert fp32_rows.fp32_rows_kernel() is None and split_linear.paying_kernel() is None
    model = build(tiny(spec="1+1R2+1", vocab_size=256))
    _, chosen = decoding.for_decoding("auto", model)
    assert decoding.FP32_KERNEL_NOTE not in chosen.reason
    assert f"{decoding.FP32_KERNEL_MISSING} (turned off by MESHLM_NATIVE=0" in chosen.reason
    assert not any(getattr(m, "kernel", None) for m in model.modules())


@pytest.fixture
def no_kernel(monkeypatch, tmp_path):
    """A cache of its own (the user's is neither read nor written), no kernel remembered."""
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "cache"))
    forget_kernels()
    yield tmp_path / "cache" / "kernels"
    forget_kernels()


@pytest.mark.parametrize("how, named", [
    ("a source missing from the install",
     "its source fp32_rows.c is missing from the install ({folder}); reinstall meshlm"),
    ("a failing compiler", "false failed to build fp32_rows.c (exit status 1); set $CC"),
    ("a source the compiler rejects", "failed to build fp32_rows.c ("),
    ("no compiler", "no C compiler on PATH ($CC, cc or gcc); install one"),
    ("a failed check", "failed its check against a float64 product; set $CC")])
@pytest.mark.parametrize("split", [2.0, 1.0])
def test_a_kernel_that_cannot_be_had_is_named_on_the_precision_line(no_kernel, monkeypatch,
                                                                    tmp_path, how, named, split):
    """Never a silent fallback: the note says why and what fixes it, then what decoding uses."""
    install = tmp_path / "install" / "meshlm" / "runtime"
    install.mkdir(parents=True)
    if how == "a source missing from the install":
        monkeypatch.setattr(fp32_rows.KERNEL, "source", install / "fp32_rows.c")
    elif how == "a failing compiler":
        monkeypatch.setenv("CC", "false")
    elif how == "a source the compiler rejects":
        (install / "fp32_rows.c").write_text("this is not C\n")
        monkeypatch.setattr(fp32_rows.KERNEL, "source", install / "fp32_rows.c")
    elif how == "no compiler":
        monkeypatch.delenv("CC", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    else:
        monkeypatch.setattr(fp32_rows.KERNEL, "check", lambda product: False)
    monkeypatch.setattr(split_linear, "split_speedup", lambda: split)
    model = build(tiny(spec="1+1R2+1", vocab_size=256))
    _, chosen = decoding.for_decoding("auto", model)
    assert fp32_rows.fp32_rows_kernel() is None and fp32_rows.unavailable() in chosen.reason
    fallback = decoding.SPLIT_NOTE if split > 1 else "linear layers keep F.linear"
    assert f"{decoding.FP32_KERNEL_MISSING} (" in chosen.reason
    assert named.format(folder=install) in chosen.reason and f"), so {fallback}" in chosen.reason
    assert "\n" not in chosen.describe()  # one line
    assert not any(getattr(m, "kernel", None) for m in model.modules())
    if how == "a source the compiler rejects":  # the compiler's own words, its first error line
        assert "error" in fp32_rows.unavailable()
    if how != "a failed check":  # a failed build leaves nothing behind, not even its temp file
        assert not no_kernel.exists() or not any(no_kernel.iterdir())


def test_generate_names_a_kernel_missing_from_the_install(no_kernel, monkeypatch, tmp_path,
                                                          capsys):
    monkeypatch.setattr(fp32_rows.KERNEL, "source", tmp_path / "install" / "fp32_rows.c")
    monkeypatch.setattr(split_linear, "split_speedup", lambda: 2.0)
    save_model(build(tiny(vocab_size=8192)), tmp_path / "ckpt")
    assert main(["generate", str(tmp_path / "ckpt"), "To be", "-t", "0", "-n", "2"]) == 0
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "generated in" in line]
    assert (f"{decoding.FP32_KERNEL_MISSING} (its source fp32_rows.c is missing from the install "
            f"({tmp_path / 'install'}); reinstall meshlm") in line


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
