"""The decode step compiled ahead of time (meshlm.generate.ahead, `meshlm generate --aot`): its
greedy tokens are the eager decoder's, with left padding, through a second generation (a new cache
bound to the same library) and from the library kept on disk (refused where another user could
have written it); it holds no weights of its own (the model's tensors are read in place); the
folder of libraries stays under its budget, the least recently used going first. The CLI's --aot:
tests/test_compiled.py."""
import os
import stat
import time

import pytest
import torch
from conftest import build, fresh_kernel, tiny

from meshlm import decoding
from meshlm.errors import ConfigError
from meshlm.generate import Sampling, ahead, generate, left_pad
from meshlm.generate.compiled import CompiledDecoder
from meshlm.kernels import bf16_rows
from meshlm.quant import quantize_model
from meshlm.quant.linear import QuantizedLinear
from meshlm.runtime import bf16_linear, precision
from meshlm.runtime.bf16_linear import Bf16Linear

PROMPTS = [[5, 6, 7, 8, 9], [10, 11]]  # left padding in the batch


@pytest.mark.slow
def test_aot_greedy_tokens_are_the_eager_decoders_fresh_and_from_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(ahead, "cache_dir", lambda: tmp_path / "cache")
    model = build(tiny(spec="1+1R2+1", d_model=64, vocab_size=256, context_length=96,
                       scheme="mesh"))
    s = Sampling(max_new_tokens=12, temperature=0, stop_at_eos=False)
    eager = generate(model, PROMPTS, s)
    folder = tmp_path / "cache" / "aot"
    folder.mkdir(mode=0o700, parents=True)
    killed = folder / ".partial-killed.pt2"  # a build a killed process left
    killed.write_bytes(b"half")
    os.utime(killed, (time.time() - 2 * ahead.STALE_SECONDS,) * 2)
    assert generate(model, PROMPTS, s, compile="aot") == eager
    (step,) = ahead._STEPS[model].values()
    assert not step.loaded and [p.name for p in folder.iterdir()] == [
        next(folder.glob("step-*.pt2")).name]  # the new library, and the stale partial removed
    assert generate(model, PROMPTS, s, compile="aot") == eager  # a new cache, the same library
    # the library reads the model's own tensors: every weight it names is the model's, not a copy
    weights = {f"model.{k}": v for k, v in model.state_dict().items()}
    named = [n for n in step.names if n in weights]
    assert named and all(step.constants[n].data_ptr() == weights[n].data_ptr() for n in named)
    ahead._STEPS.clear()
    assert generate(model, PROMPTS, s, compile="aot") == eager
    assert ahead._STEPS[model][next(iter(ahead._STEPS[model]))].loaded  # from the disk
    # a library another user could have replaced is refused, not loaded
    (library,) = folder.glob("step-*.pt2")
    library.chmod(library.stat().st_mode | stat.S_IWOTH)
    ahead._STEPS.clear()
    with pytest.raises(ConfigError, match="could have been written by another user"):
        generate(model, PROMPTS, s, compile="aot")
    library.chmod(library.stat().st_mode & ~stat.S_IWOTH)


def test_prune_removes_the_least_recently_used_past_the_budget_and_stale_partials(tmp_path):
    now = time.time()

    def library(name: str, size: int, age: float):
        path = tmp_path / name
        path.write_bytes(b"x" * size)
        os.utime(path, (now - age, now - age))
        return path

    new, used, old, oldest = (library(f"step-{n}.pt2", 100, age)
                              for n, age in (("a", 0), ("b", 10), ("c", 20), ("d", 30)))
    stale, building = library(".partial-x.pt2", 5, 7200), library(".partial-y.pt2", 5, 60)
    other = library("notes.txt", 1000, 9999)
    assert sorted(ahead.prune(tmp_path, keep=new, budget=250)) == sorted([old, oldest, stale])
    assert {p.name for p in tmp_path.iterdir()} == {new.name, used.name, building.name, other.name}
    # the library just built stays even when it alone is over the budget
    assert ahead.prune(tmp_path, keep=used, budget=50) == [new]
    assert ahead.prune(tmp_path, keep=used, budget=50) == []  # nothing left to remove


def teacher_forced_logits(decoder: CompiledDecoder, steps: int) -> list[torch.Tensor]:
    """The prefill's logits and each step's, PROMPTS prefilled, the same tokens fed whatever the
    logits (two decoders' steps stay comparable where a near-tie would part their greedy
    tokens)."""
    seen, ids = [], iter(range(20, 21 + steps))
    decoder.choose = lambda logits: seen.append(logits.float()) or torch.full(
        (len(PROMPTS),), next(ids))
    batch = decoder.prefill(*left_pad(PROMPTS, 1, torch.device("cpu")))
    for _ in range(steps):
        decoder.step(batch)
    return seen


@pytest.mark.slow
def test_a_w4a8_model_in_bf16_ahead_of_time_reads_every_tensor_in_place(tmp_path, monkeypatch):
    """bf16 forced, its C kernel in the step (as if its probe found it faster) and w4a8 layers
    through theirs: the library binds every tensor it names to this process's (the w4a8 layers'
    packed operands too), holds none of its own, and gives the eager static step's logits to bf16
    rounding."""
    model, _ = quantize_model(build(tiny(spec="1+1R2+1", d_model=64, vocab_size=256,
                                         context_length=96, scheme="mesh")),
                              4, parts=("prelude", "cores", "coda"), activations="int8")
    with fresh_kernel(bf16_rows.KERNEL, monkeypatch, tmp_path / "cache"):
        monkeypatch.setattr(bf16_linear, "kernel_speedup",
                            lambda kernel: {"kernel_over_linear": 2.0,
                                            "batch_kernel_over_linear": 0.5})
        device, chosen = decoding.for_decoding("bf16", model)
        assert any(isinstance(m, Bf16Linear) for m in model.modules())
        assert all(m.row_kernel is not None for m in model.modules()
                   if isinstance(m, QuantizedLinear))
        with precision.autocast(device, chosen):
            eager, aot = (teacher_forced_logits(
                CompiledDecoder(model, model.schedule(), None, 8, compiled=False, ahead=ahead_),
                steps=8) for ahead_ in (False, True))
    assert len(eager) == len(aot) == 9
    for ours, theirs in zip(aot, eager):
        torch.testing.assert_close(ours, theirs, rtol=0.05, atol=0.05)
    (step,) = ahead._STEPS[model].values()
    assert step.names == set(step.runner.get_constant_fqns())  # none of its own
    tensors = {f"model.{n}": t for n, t in [*model.named_parameters(), *model.named_buffers()]}
    assert {n for n in step.names if "._int4rows_" in n}  # the packed operands, named
    assert all(step.constants[n].data_ptr() == tensors[n].data_ptr()
               for n in step.names if n in tensors)
