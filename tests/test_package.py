"""The package stands alone: a wheel built from the checkout, installed outside it, runs the shipped
studies and configs from a directory that is not the checkout, ships every C kernel source (the
sdist too) and decodes with the kernels the checkout decodes with; an install that lacks one names
it on the precision line."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import build, tiny

from meshlm import decoding
from meshlm.checkpoint import save_model
from meshlm.quant import quantize_model

ROOT = Path(__file__).resolve().parents[1]
# which kernels this process has, and where its meshlm comes from
KERNELS = """import json, meshlm
from meshlm.kernels import bf16_rows, build, fp32_rows
from meshlm.kernels.kernel import compiled_operators  # as a compiled step: operators.cpp built
from meshlm.quant import int4_bf16_kernel as int4_bf16_rows
from meshlm.quant import int4_kernel as int4_rows, row_kernel as int8_rows
from meshlm.quant import int8_bf16_kernel as int8_bf16_rows
ALL = (fp32_rows, bf16_rows, int8_rows, int4_rows, int4_bf16_rows, int8_bf16_rows)
print(json.dumps({"package": meshlm.__file__,
                  "fp32_rows": fp32_rows.fp32_rows_kernel() is not None,
                  "bf16_rows": bf16_rows.bf16_rows_kernel() is not None,
                  "int8_rows": int8_rows.int8_row_kernel() is not None,
                  "int4_rows": int4_rows.int4_rows_kernel() is not None,
                  "int4_bf16_rows": int4_bf16_rows.int4_bf16_rows_kernel() is not None,
                  "int8_bf16_rows": int8_bf16_rows.int8_bf16_rows_kernel() is not None,
                  "operators": compiled_operators() or [k.KERNEL.implemented for k in ALL],
                  "why_not": [build.why_not(k.KERNEL.source) for k in ALL]}))
"""
CHECKOUT_MESHLM = [sys.executable, "-c", "import sys; from meshlm.cli import main; "
                                         "sys.exit(main(sys.argv[1:]))"]


def run(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (f"{' '.join(args)} "
                                  f"failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return done.stdout


def c_sources() -> list[str]:
    """Every C and C++ source and header the checkout has under src/meshlm, as the package's
    paths name them."""
    return sorted(p.relative_to(ROOT / "src").as_posix() for pattern in ("*.c", "*.cpp", "*.h")
                  for p in (ROOT / "src" / "meshlm").rglob(pattern))


def copy_checkout(folder: Path) -> Path:
    """What a build reads (src, pyproject.toml, README.md), copied: an in-tree build would leave
    build/ and egg-info in the checkout."""
    shutil.copytree(ROOT / "src", folder / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, folder / name)
    return folder


def build_env() -> dict[str, str]:
    """pip's environment: this one (pip's own configuration included) less what would point
    Python at the checkout."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def clean_env(home: Path) -> dict[str, str]:
    """A user's plain environment for meshlm: no PYTHONPATH, no MESHLM_* or torch settings of the
    caller's, a HOME of its own; the caller's $CC kept (the kernels' compiler)."""
    keep = {k: os.environ[k] for k in ("PATH", "LANG", "TMPDIR", "CC") if k in os.environ}
    return {**keep, "HOME": str(home), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel built from a copy of the checkout (no build isolation: nothing downloaded),
    installed with --target into a folder outside it; `env` (clean_env) imports that folder first,
    the checkout's venv supplying torch and the other dependencies."""
    root = tmp_path_factory.mktemp("package")
    source = copy_checkout(root / "source")
    env = build_env()
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
         str(root), str(source)], root, env)
    wheel = next(root.glob("meshlm-*.whl"))
    site = root / "site"
    run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
         str(wheel)], root, env)
    return SimpleNamespace(wheel=wheel, site=site,
                           env={**clean_env(root / "home"), "PYTHONPATH": str(site)})


@pytest.mark.slow
def test_a_wheel_installed_outside_the_checkout_runs_the_shipped_studies_and_configs(installed,
                                                                                     tmp_path):
    names = zipfile.ZipFile(installed.wheel).namelist()
    shipped = sorted(p.relative_to(ROOT / "src").as_posix()
                     for p in (ROOT / "src/meshlm/configs").rglob("*.yaml"))
    assert shipped and set(shipped) <= set(names), "the wheel lacks shipped configs"
    assert "meshlm/evaluation/tasks/local/meshlm_recite.yaml" in names  # the shipped lm-eval task
    site = installed.site
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**installed.env, "MESHLM_CACHE": str(tmp_path / "cache")}
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


def decode(meshlm: list[str], folder: Path, cwd: Path, env: dict[str, str]) -> tuple[str, str]:
    """(the text `meshlm generate` writes for `folder`, its precision line)."""
    done = subprocess.run([*meshlm, "generate", str(folder), "To be, or not", "-t", "0", "-n", "8"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"meshlm generate failed:\n{done.stderr[-2000:]}"
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("generated in ")]
    return done.stdout, line


def cache_with_probes(folder: Path, measured: Path) -> dict[str, str]:
    """A kernel cache of its own holding the probe figures measured into `measured` (machine.json),
    so both installs take the same timing decisions yet build their kernels from their own
    sources."""
    folder.mkdir(parents=True)
    shutil.copy(measured / "machine.json", folder / "machine.json")
    return {"MESHLM_CACHE": str(folder)}


@pytest.mark.slow
def test_the_installed_wheel_ships_every_c_kernel_and_decodes_with_the_checkouts(installed,
                                                                                 tmp_path):
    sources = c_sources()
    assert {"meshlm/kernels/fp32_rows.c", "meshlm/kernels/bf16_rows.c",
            "meshlm/kernels/int8_rows.c", "meshlm/kernels/int4_rows.c",
            "meshlm/kernels/int4_bf16_rows.c", "meshlm/kernels/int8_bf16_rows.c",
            "meshlm/kernels/operators.cpp", "meshlm/kernels/rows.h"} <= set(sources)
    names = zipfile.ZipFile(installed.wheel).namelist()
    assert set(sources) <= set(names), "the wheel lacks C kernel sources (package-data)"
    assert all((installed.site / name).is_file() for name in sources)
    # fp32 layers (the kernel's or the split layout's) and int8-activation ones (the row kernel's)
    model = build(tiny(spec="1+1R2+1", vocab_size=8192))
    quantized, spec = quantize_model(model, 8, ("cores",), activations="int8")
    folder = save_model(quantized, tmp_path / "q",
                        {"model": model.config.to_dict(), "step": 0, "quantization": spec})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # the checkout (its editable install) measures the probes; the wheel reads their figures
    checkout_env = {**clean_env(tmp_path / "home"),
                    "MESHLM_CACHE": str(tmp_path / "checkout-cache")}
    checkout = json.loads(run([sys.executable, "-c", KERNELS], elsewhere, checkout_env))
    assert Path(checkout["package"]).is_relative_to(ROOT / "src")
    checkout_decoded = decode(CHECKOUT_MESHLM, folder, elsewhere, checkout_env)
    env = {**installed.env, **cache_with_probes(tmp_path / "cache", tmp_path / "checkout-cache")}
    wheel = json.loads(run([sys.executable, "-c", KERNELS], elsewhere, env))
    assert Path(wheel.pop("package")).is_relative_to(installed.site)
    checkout.pop("package")
    assert wheel == checkout, "the installed wheel loads other kernels than the checkout"
    meshlm = [sys.executable, str(installed.site / "bin" / "meshlm")]
    assert decode(meshlm, folder, elsewhere, env) == checkout_decoded
    # every kernel this machine can have was built from the installed sources
    kernels = ("fp32_rows", "bf16_rows", "int8_rows", "int4_rows", "int4_bf16_rows",
               "int8_bf16_rows")
    if all(checkout[k] for k in kernels):
        built = {p.name.split("-")[0] for p in (tmp_path / "cache" / "kernels").glob("*.so")}
        cpp = checkout["operators"] == ["c++"] * len(kernels)  # operators.cpp built here
        libraries = {Path(name).stem for name in sources if not name.endswith(".h")}
        assert built == libraries - (set() if cpp else {"operators"})

    # an install that lacks the sources says so on the precision line, and decodes the same text
    bare = tmp_path / "bare"
    shutil.copytree(installed.site, bare)
    for name in sources:
        (bare / name).unlink()
    env = {**env, "PYTHONPATH": str(bare),
           **cache_with_probes(tmp_path / "bare-cache", tmp_path / "checkout-cache")}
    text, line = decode([sys.executable, str(bare / "bin" / "meshlm")], folder, elsewhere, env)
    assert text == checkout_decoded[0]
    assert f"{decoding.FP32_KERNEL_MISSING} (its source fp32_rows.c is missing from the " \
           f"install ({bare / 'meshlm' / 'kernels'}); reinstall meshlm" in line
    # int8-activation layers take the kernel on every CPU (every row where torch._int_mm's sums
    # are not exact), so its absence is named on every CPU
    assert f"{decoding.ROW_KERNEL_MISSING} (its source int8_rows.c is missing" in line


@pytest.mark.slow
def test_the_sdist_carries_every_c_kernel_source(tmp_path):
    """Built offline by setuptools' PEP 517 hook, as `python -m build --sdist --no-isolation`
    would."""
    source = copy_checkout(tmp_path / "source")
    hook = "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])"
    run([sys.executable, "-c", hook, str(tmp_path / "dist")], source, build_env())
    (sdist,) = (tmp_path / "dist").glob("meshlm-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {f"src/{name}" for name in c_sources()} <= names, "the sdist lacks C kernel sources"
