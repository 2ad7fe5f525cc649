"""The CI plugin: under CI=true slow tests run and a skip fails, except a GPU test's; locally
nothing changes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

SAMPLE = '''
import pytest

@pytest.mark.slow
def test_slow():
    pass

def test_needs_wheel():
    pytest.skip("the eval wheel is not cached")

@pytest.mark.gpu
def test_marked_gpu():
    pytest.skip("no device")

@pytest.mark.skipif(True, reason="CUDA is not available")
def test_cuda_reason():
    pass
'''


def run_sample(tmp_path: Path, ci: str) -> str:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -m 'not slow'\nmarkers =\n  slow: "
                                         "s\n  gpu: g\n")
    env = {**os.environ, "CI": ci, "PYTHONPATH": str(HERE)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "ciskips", "-p",
                           "no:cacheprovider",
                           str(tmp_path)], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120)
    return proc.stdout.splitlines()[-1]


def test_under_ci_slow_tests_run_and_skips_fail_except_gpu(tmp_path):
    assert run_sample(tmp_path, "true").strip("= ").startswith("1 failed, 1 passed, 2 skipped")


def test_locally_slow_is_deselected_and_skips_stay_skips(tmp_path):
    assert run_sample(tmp_path, "").strip("= ").startswith("3 skipped, 1 deselected")
