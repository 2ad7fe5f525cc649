"""benchmarks/gpu_check.py runs where only torch and meshlm's light dependencies are installed: a
tiny CPU smoke run in a subprocess in which lm-eval, datasets and transformers cannot be
imported."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from trainkit import ROOT, make_prepared

BLOCKED = """
import runpy, sys
for name in ("lm_eval", "datasets", "transformers"):
    sys.modules[name] = None  # `import lm_eval` now raises ImportError
from meshlm.train import parallel
# the eager-then-compiled sequence, without minutes of compiling
parallel.compile_layers = lambda model: None
sys.argv = ["gpu_check.py", *sys.argv[1:]]
runpy.run_path("benchmarks/gpu_check.py", run_name="__main__")
"""


def test_gpu_check_smoke_runs_without_lm_eval_datasets_or_transformers(tmp_path_factory, tmp_path):
    data = make_prepared(tmp_path_factory)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    args = ["--device", "cpu", "--smoke", "--eager-steps", "1", "--warmup", "1", "--steps", "2",
            "--data", str(data),
            "--out", str(tmp_path)]
    proc = subprocess.run([sys.executable, "-c", BLOCKED, *args], cwd=ROOT, env=env,
                          capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    # 1 + 1 eager, 1 + 2
    assert result["backend"] == "gloo" and result["ddp"] and result["steps_total"] == 5
    assert result["compile"] and result["eager_tokens_per_s"] > 0 and result["compile_speedup"] > 0
    # the run policy's choice for this CPU: bf16 autocast where it has native bf16 (a probe), else
    # fp32
    import torch

    from meshlm.runtime.precision import choose
    expected = "bf16 autocast" if choose("auto", torch.device("cpu")).dtype else "fp32"
    assert result["model"]["spec"] == "1+2R2+1" and result["precision"] == expected
    assert result["tokens_per_s"] > 0 and 0 < result["mfu_vs_measured_peak"]
    assert result["first_loss"] > 0 and result["val_loss"] > 0
