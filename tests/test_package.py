"""The package stands alone: a wheel built from the checkout, installed outside it, runs the shipped
studies and configs from a directory that is not the checkout."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (f"{' '.join(args)} "
                                  f"failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return done.stdout


@pytest.mark.slow
def test_a_wheel_installed_outside_the_checkout_runs_the_shipped_studies_and_configs(tmp_path):
    # build from a copy: an in-tree build would leave build/ in the checkout
    source = tmp_path / "source"
    shutil.copytree(ROOT / "src", source / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
         str(tmp_path),
         str(source)], tmp_path, env)
    wheel = next(tmp_path.glob("meshlm-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(p.relative_to(ROOT / "src").as_posix()
                     for p in (ROOT / "src/meshlm/configs").rglob("*.yaml"))
    assert shipped and set(shipped) <= set(names), "the wheel lacks shipped configs"
    assert "meshlm/evaluation/tasks/local/meshlm_recite.yaml" in names  # the shipped lm-eval task
    site = tmp_path / "site"
    run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
         str(wheel)], tmp_path, env)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**env, "PYTHONPATH": str(site), "MESHLM_CACHE": str(tmp_path / "cache")}
    where = run([sys.executable, "-c", "import meshlm; print(meshlm.__file__)"], elsewhere,
                env).strip()
    # not the editable checkout
    assert Path(where).is_relative_to(site), f"imported {where}, not the installed wheel"
    meshlm = [sys.executable, str(site / "bin" / "meshlm")]  # the installed console script
    plan = run([*meshlm, "reproduce", "--quick", "--plan"], elsewhere, env)
    assert "GPU-hours in all" in plan and "mesh-s0" in plan
    printed = run([*meshlm, "train", "--config", "cpu/small-anchor.yaml", "--print-config"],
                  elsewhere, env)
    assert "name: small-anchor" in printed and "scheme: anchor" in printed
    printed = run([*meshlm, "train", "--config", "configs/paper/410m-4+8R2+4-mesh.yaml",
                   "--print-config"],
                  elsewhere, env)
    assert "tokenizer: pythia" in printed
