"""The run policy (meshlm.runtime): precision by detection + cached probe, malloc tuning before
torch loads, the compile rule, and cached MFU peaks. The bf16-CPU path is tested by faking the
detection, so these tests pass the same on CPUs with and without native bf16."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from trainkit import ROOT, cli_command, tiny_train

from meshlm import machine
from meshlm.errors import ConfigError
from meshlm.runtime import allocator, peaks, precision
from meshlm.runtime import compile as compile_policy
from meshlm.train.config import TrainConfig, load_config
from meshlm.train.trainer import train

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Every test measures into its own cache, never the user's."""
    monkeypatch.setenv("MESHLM_CACHE", str(tmp_path / "cache"))


def fake_cpu(monkeypatch, flags=(), bf16_gflops=None, fp32_gflops=100.0):
    """Pretend this CPU lists `flags` and its probe measures the given GEMM speeds (counting
    probes)."""
    monkeypatch.setattr(machine, "cpu_info",
                        lambda: {"model": "Fake CPU", "flags": frozenset(flags)})
    probes = []

    def gemm(dtype, reps=5):
        probes.append(dtype)
        return bf16_gflops if dtype == torch.bfloat16 else fp32_gflops

    monkeypatch.setattr(precision, "_gemm_gflops", gemm)
    return probes


def test_explicit_precisions_are_honoured():
    assert precision.choose("fp32", CPU).dtype is None
    assert precision.choose("bf16", CPU).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="must be one of"):
        precision.choose("fp16", CPU)


def test_auto_is_fp32_without_native_bf16_and_runs_no_probe(monkeypatch):
    probes = fake_cpu(monkeypatch, flags=("avx2", "fma"))
    chosen = precision.choose("auto", CPU)
    assert chosen.dtype is None and "no native bf16" in chosen.reason and probes == []


@pytest.mark.parametrize("flag", ["amx_bf16", "avx512_bf16"])
def test_auto_is_bf16_when_the_flag_and_the_probe_agree(monkeypatch, flag):
    probes = fake_cpu(monkeypatch, flags=("avx2", flag), bf16_gflops=700.0)
    chosen = precision.choose("auto", CPU)
    assert chosen.dtype == torch.bfloat16 and flag in chosen.reason and "7.0x" in chosen.reason
    assert precision.choose("auto", CPU).dtype == torch.bfloat16
    assert probes == [torch.bfloat16, torch.float32]  # measured once, then read from the cache
    entry = next(iter(json.loads(machine.path().read_text()).values()))
    assert entry["value"] == {"bf16_gflops": 700.0, "fp32_gflops": 100.0}
    assert entry["date"] and "512^3" in entry["method"]


def test_auto_falls_back_to_fp32_when_a_listed_flag_is_slow(monkeypatch):
    # e.g. a hypervisor hiding the units
    fake_cpu(monkeypatch, flags=("avx512_bf16",), bf16_gflops=1.5)
    chosen = precision.choose("auto", CPU)
    assert chosen.dtype is None and "avx512_bf16 listed but" in chosen.reason


def test_auto_on_cuda_follows_the_gpu(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert precision.choose("auto", cuda).dtype == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert precision.choose("auto", cuda).dtype is None


def test_this_machine_gets_bf16_only_with_native_units():
    native = any(f in machine.cpu_info()["flags"] for f in precision.BF16_CPU_FLAGS)
    if not native:
        assert precision.choose("auto", CPU).dtype is None


def test_compile_rule():
    cpu, cuda = CPU, torch.device("cuda")
    assert not compile_policy.choose("auto", cpu, 10**6).enabled
    assert compile_policy.choose("auto", cuda, compile_policy.CUDA_MIN_STEPS).enabled
    assert not compile_policy.choose("auto", cuda, compile_policy.CUDA_MIN_STEPS - 1).enabled
    assert (compile_policy.choose("true", cpu, 1).enabled
            and not compile_policy.choose("false", cuda, 10**6).enabled)


@pytest.mark.parametrize("value, expected",
                         [(True, "true"), (False, "false"), ("auto", "auto"), ("True", "true")])
def test_train_compile_accepts_booleans_and_auto(value, expected):
    assert TrainConfig(compile=value).compile == expected
    assert load_config(None, [f"compile={value}"]).compile == expected


def test_train_compile_rejects_other_values():
    with pytest.raises(ConfigError, match="compile='sometimes' must be one of auto, true, false"):
        load_config(None, ["compile=sometimes"])


def test_peaks_are_measured_once_and_cached_with_date_and_method(monkeypatch):
    calls = []
    monkeypatch.setattr(peaks, "measure_matmul_peak", lambda *a, **k: calls.append(a) or 5e10)
    first = peaks.device_peak(CPU, None)
    second = peaks.device_peak(CPU, None)
    assert first == second and first[0] == 5e10 and len(calls) == 1
    assert ("float32 2048^3 matmul" in first[1] and "measured 20" in first[1]
            and "cached in" in first[1])
    assert peaks.device_peak(CPU, None, override=1e12) == (1e12, "train.peak_flops")


def test_the_cpu_peak_is_timed_on_cpu_time_so_a_busy_machine_does_not_lower_it(monkeypatch):
    import time

    clocks = []
    monkeypatch.setattr(peaks, "measure_matmul_peak",
                        lambda *a, clock, **k: clocks.append(clock) or 5e10)
    peaks.device_peak(CPU, None)
    start = clocks[0]()
    # time the process is not running (as when other work has the cores) does not count
    time.sleep(0.05)
    assert clocks[0]() - start < 0.01
    assert "timed on CPU time per thread" in peaks.device_peak(CPU, None)[1]


def test_a_peak_cached_by_another_method_is_measured_again(monkeypatch):
    from meshlm import machine

    calls = []
    monkeypatch.setattr(peaks, "measure_matmul_peak", lambda *a, **k: calls.append(a) or 5e10)
    peaks.device_peak(CPU, None)
    data = machine.read()
    (key,) = data
    # wall clock
    data[key] = {**data[key], "value": 8e9,
                 "method": "best float32 2048^3 matmul over 2 s, 2 threads"}
    machine.path().write_text(json.dumps(data))
    assert peaks.device_peak(CPU, None)[0] == 5e10 and len(calls) == 2


def test_a_bf16_run_divides_by_the_bf16_peak(monkeypatch):
    monkeypatch.setattr(peaks, "measure_matmul_peak",
                        lambda device, dtype, **k: {torch.float32: 1e11}.get(dtype, 7e11))
    assert (peaks.device_peak(CPU, torch.bfloat16)[0] == 7e11
            and peaks.device_peak(CPU, None)[0] == 1e11)


def test_runs_record_the_chosen_precision_and_compile(prepared, tmp_path, monkeypatch, capsys):
    fake_cpu(monkeypatch, flags=("avx2",))
    lines = []
    result = train(tiny_train(prepared, tmp_path, steps=1, save_every=0), log=lines.append)
    first = json.loads((result.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["kind"] == "run" and first["dtype"] == "fp32" and first["compile"] is False
    assert "no native bf16" in first["dtype_reason"] and first["peak_source"] == "train.peak_flops"
    assert ("fp32 (auto: this CPU has no native bf16" in lines[0]
            and "compile off (auto: on CPU" in lines[0])


def test_detected_bf16_cpu_trains_under_bf16_autocast(prepared, tmp_path, monkeypatch):
    fake_cpu(monkeypatch, flags=("amx_bf16",), bf16_gflops=700.0)
    seen = []
    original = precision.autocast
    monkeypatch.setattr(precision, "autocast",
                        lambda device, p: seen.append(p.dtype) or original(device, p))
    result = train(tiny_train(prepared, tmp_path, steps=1, micro_batch=8, save_every=0))
    first = json.loads((result.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["dtype"] == "bf16" and "amx_bf16" in first["dtype_reason"]
    assert seen and set(seen) == {torch.bfloat16} and torch.isfinite(torch.tensor(result.val_loss))


def test_without_glibc_malloc_is_left_alone(monkeypatch):
    monkeypatch.setitem(allocator._state, "done", None)
    monkeypatch.setattr(allocator, "_glibc", lambda: None)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert allocator.tune() == "malloc left alone (not glibc)"
    import os

    assert "MALLOC_MMAP_THRESHOLD_" not in os.environ


PROBE = """
import sys
from meshlm import cli
from meshlm.runtime import allocator
tune = allocator.tune
def spy():
    print("torch imported before tuning:", "torch" in sys.modules)
    print(tune())
    import os; print("child env:", os.environ.get("MALLOC_MMAP_THRESHOLD_"))
    return tune()
allocator.tune = spy
cli.main(sys.argv[1:])
"""


def test_meshlm_train_tunes_malloc_before_torch_loads():
    _, env = cli_command()
    env = {k: v for k, v in env.items() if not k.startswith("MALLOC_") and k != allocator.OPT_OUT}
    out = subprocess.run([sys.executable, "-c", PROBE, "train", "--print-config"],
                         capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=120).stdout
    assert "torch imported before tuning: False" in out
    if allocator._glibc() is not None:
        assert "malloc tuned" in out and f"child env: {1 << 30}" in out


@pytest.mark.parametrize("argv", [["eval", "/nonexistent"], ["probe", "/nonexistent"],
                                  ["generate", "/nonexistent", "hi"],
                                  ["reproduce", "/nonexistent.yaml"],
                                  ["serve", "/nonexistent"],
                                  ["finetune", "/nonexistent", "/nonexistent.jsonl"]])
def test_every_long_running_command_tunes_malloc_first(argv, monkeypatch, capsys):
    from meshlm import cli

    calls = []
    monkeypatch.setattr(allocator, "tune", lambda: calls.append(argv[0]) or "")
    assert cli.main(argv) != 0  # each fails on its missing input, after tuning
    assert (calls == [argv[0]]
            and set(cli.LONG_RUNNING) == {"train", "finetune", "eval", "probe", "generate",
                                          "reproduce", "serve"})


def test_malloc_opt_out_leaves_the_defaults():
    _, env = cli_command()
    env = {**{k: v for k, v in env.items() if not k.startswith("MALLOC_")},
           allocator.OPT_OUT: "default"}
    code = ("from meshlm.runtime import allocator; import os; print(allocator.tune(), "
            "os.environ.get('MALLOC_TOP_PAD_'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60).stdout
    assert out.strip() == "malloc left at its defaults (MESHLM_MALLOC=default) None"


def test_cache_keys_tell_cpus_of_one_model_name_apart_by_their_flags(monkeypatch):
    """A hypervisor may name an AVX2-only and an AVX-512 EPYC alike ("AMD EPYC"); a shared home
    folder must not hand one the other's probe."""
    ids = []
    for flags in (("avx2",), ("avx2", "avx512f", "avx512_bf16"),
                  ("avx512_bf16", "avx2", "avx512f")):
        monkeypatch.setattr(machine, "cpu_info",
                            lambda flags=flags: {"model": "AMD EPYC", "flags": frozenset(flags)})
        ids.append(machine.cpu_id())
    assert ids[0] != ids[1] == ids[2] and all(i.startswith("AMD EPYC #") for i in ids)


def test_a_race_takes_turns_and_keeps_each_steps_fastest_call(monkeypatch):
    calls, times = [], iter([0.0, 3.0, 3.0, 4.0, 10.0, 11.0, 11.0, 15.0])  # a: 3, 1; b: 1, 4
    monkeypatch.setattr(machine.time, "perf_counter", lambda: next(times))
    steps = {name: (lambda name=name: calls.append(name)) for name in ("a", "b")}
    raced = machine.race(steps, reps=2, fastest="a")
    assert calls == ["a", "b"] + ["a", "b"] * 2  # one untimed call each, then rounds in turn
    assert raced == {"a_ms": 1000.0, "b_ms": 1000.0, "a_over_b": 1.0}


def test_a_cold_race_reads_past_the_caches_before_every_timed_call(monkeypatch):
    reads = []
    monkeypatch.setattr(machine, "flush_bytes", lambda: 4096)
    monkeypatch.setattr(machine.torch.Tensor, "sum", lambda self: reads.append(self.numel()))
    machine.race({"a": lambda: None, "b": lambda: None}, reps=3, fastest="a", cold=True)
    assert reads == [1024] * 6


@pytest.mark.parametrize("sizes, expected", [({"index0": "48K", "index3": "32768K"}, 64 << 20),
                                             ({"index2": "2048K", "index3": "105M"}, 210 << 20),
                                             ({"index3": "1179648K"}, 1 << 30),
                                             ({}, 256 << 20), ({"index3": "odd"}, 256 << 20)])
def test_the_flush_covers_twice_the_largest_cache_within_bounds(tmp_path, sizes, expected):
    for index, size in sizes.items():
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert machine.flush_bytes(tmp_path) == expected
