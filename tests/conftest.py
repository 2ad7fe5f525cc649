"""Shared fixtures: tiny configs that run in milliseconds on CPU."""
from __future__ import annotations

import contextlib

import pytest
import torch

from meshlm.config import ModelConfig
from meshlm.model import MeshLM

pytest_plugins = ["ciskips"]  # under CI=true: slow tests run, skips fail (except GPU tests)

# Tiny models gain nothing from intra-op threads, and on a busy 2-core machine two threads per
# process make them up to 100× slower (threads wait on each other). Subprocesses the tests start set
# their own.
torch.set_num_threads(1)


# bf16 autocast vs. fp32 logits of the tiny models (|logits| <= 0.51): the largest difference
# measured over 20 seeds per backbone (GPT-NeoX, Llama, OLMoE) is 2.1e-3, about one bf16 rounding
# step (2^-8 · 0.5 = 2e-3). The bound is about twice that: torch's own bf16 rtol (1.6e-2, 4 bf16
# steps) plus atol 4e-3.
BF16_LOGITS = dict(rtol=1.6e-2, atol=4e-3)


def tiny(**overrides) -> ModelConfig:
    """A 4-layer-equivalent model small enough for float64 gradchecks."""
    base = dict(spec="1+1R2+1", d_model=32, n_heads=4, vocab_size=97, context_length=64,
                scheme="mesh")
    return ModelConfig(**{**base, **overrides})


def build(cfg: ModelConfig, seed: int = 0, dtype=torch.float32) -> MeshLM:
    torch.manual_seed(seed)
    return MeshLM(cfg).to(dtype).eval()


def copy_layers(src: MeshLM, dst: MeshLM) -> None:
    """Copy every non-scheme parameter (embeddings, layers, norms, head) from src into dst."""
    missing, unexpected = dst.load_state_dict(
        {k: v for k, v in src.state_dict().items() if not k.startswith("scheme.")}, strict=False)
    assert all(k.startswith("scheme.") for k in missing), missing
    assert not unexpected, unexpected


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """A small prepared corpus (default tokenizer) for the training, evaluation and report tests."""
    from trainkit import make_prepared

    return make_prepared(tmp_path_factory)


@pytest.fixture(scope="session")
def llama_folder(tmp_path_factory):
    """A small random LlamaForCausalLM (4 layers, GQA) saved the transformers way, with a
    tokenizer.json (a copy of meshlm's default, so prepared data match); returns (folder, the
    transformers model)."""
    import shutil

    from transformers import LlamaForCausalLM

    from meshlm.backbones import BACKBONES
    from meshlm.data.tokenizer import DEFAULT_PATH
    from meshlm.interop.families import hf_config

    cfg = ModelConfig(spec="4", d_model=64, n_heads=4, n_kv_heads=2, vocab_size=8192,
                      context_length=64,
                      mlp_hidden=96, backbone="llama", scheme="vanilla", scale_embeddings=False)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_config(cfg, BACKBONES["llama"])).eval()
    folder = tmp_path_factory.mktemp("llama") / "llama-tiny"
    hf.save_pretrained(folder)
    shutil.copyfile(DEFAULT_PATH, folder / "tokenizer.json")
    return folder, hf


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def forget_kernels() -> None:
    """Every kernel's product forgotten (Kernel.product caches it per process). A test that makes
    kernels unbuildable (MESHLM_NATIVE=0, no compiler, a failing build) and decodes has every
    kernel asked, and none of those Nones may reach a later test of the same worker."""
    from meshlm import decoding  # noqa: F401 - imports every kernel's module
    from meshlm.kernels.kernel import KERNELS

    for kernel in KERNELS:
        kernel.product.cache_clear()


@contextlib.contextmanager
def fresh_kernel(kernel, monkeypatch, cache):
    """`kernel` (a meshlm.kernels.kernel.Kernel) built into the cache folder `cache`, none
    remembered from earlier in this process; after, every kernel forgotten (forget_kernels)."""
    monkeypatch.setenv("MESHLM_CACHE", str(cache))
    kernel.product.cache_clear()
    built = kernel.product()
    assert built is not None, "this machine has a C compiler (cc or gcc): the kernel builds"
    try:
        yield built
    finally:
        forget_kernels()


def probe_says(monkeypatch, module, ratio: float, batch: float = 1.0) -> None:
    """The probe of a weight-only kernel `module` (meshlm.quant.int4_bf16_kernel, .int8_bf16_kernel)
    answers as if this machine had measured the kernel `ratio` times torch's speed at one row and
    `batch` times at a served batch's rows."""
    monkeypatch.setattr(module, "kernel_speedup",
                        lambda kernel: {"kernel_over_torch": ratio,
                                        "batch_kernel_over_torch": batch})


# C flag sets that build a kernel's other paths on this CPU, as the CPUs that lack an instruction
# set build it: each path falls back to the next where this CPU lacks its instructions too
OLDER_CPUS = {"plain-loop": (), "without-avx512-bf16": ("-march=native", "-mno-avx512bf16"),
              "avx2": ("-march=native", "-mno-avx512f", "-mno-avxvnni")}


def built_for(kernel, flags: tuple[str, ...], folder):
    """`kernel` (a meshlm.kernels.kernel.Kernel) compiled with the C flags `flags` (OLDER_CPUS)
    into `folder`, bound and wrapped as its callers take it, its check not yet run."""
    import ctypes
    import subprocess

    from meshlm.kernels import build as kernel_build

    cc = kernel_build.compiler()
    assert cc is not None, "this machine has a C compiler (cc or gcc)"
    target = folder / f"{kernel.source.stem}-older.so"
    subprocess.run([cc, "-O3", *flags, "-shared", "-fPIC", str(kernel.source), "-o", str(target)],
                   check=True, capture_output=True, timeout=120)
    return kernel.wrap(kernel.bound(ctypes.CDLL(str(target))))


@pytest.fixture
def native_off(monkeypatch):
    """MESHLM_NATIVE=0 as a process started with it: every kernel unbuilt, and forgotten after,
    so later tests in this process build theirs again."""
    monkeypatch.setenv("MESHLM_NATIVE", "0")
    forget_kernels()
    yield
    forget_kernels()


@pytest.fixture
def traced_only(monkeypatch):
    """The compiled step through Dynamo's tracing and guards, run by the eager backend (no
    Inductor: seconds, not a minute), counting graph breaks and compiles."""
    from torch._dynamo.utils import counters

    from meshlm.generate import steps

    torch._dynamo.reset()
    steps.forget()
    monkeypatch.setattr(steps, "BACKEND", "eager")
    counters.clear()
    yield counters
    torch._dynamo.reset()
    steps.forget()
