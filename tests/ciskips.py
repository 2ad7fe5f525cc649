"""pytest plugin (loaded by conftest.py): under CI=true, run the slow tests too and fail on any skip
but GPU.

A skipped test is a test that did not run; in CI that hides a missing install step (an uncached eval
wheel, no browser), so CI turns the skip into a failure that names the reason. Tests that need a GPU
are the exception: CI has none. They are the ones marked `gpu`, or whose skip reason names CUDA or a
GPU. Locally nothing changes: slow tests stay deselected (`-m slow` runs them) and skips stay skips.
"""
from __future__ import annotations

import os
import re

import pytest

GPU_REASON = re.compile(r"\b(cuda|gpus?)\b", re.IGNORECASE)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def pytest_configure(config):
    if in_ci() and config.option.markexpr == "not slow":  # the default from pyproject's addopts
        config.option.markexpr = ""


def pytest_report_header(config):
    if in_ci():
        return "CI=true: slow tests included; a skip fails the run unless the test needs a GPU"
    return None


def _needs_gpu(item, report) -> bool:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return item.get_closest_marker("gpu") is not None or bool(GPU_REASON.search(reason))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (in_ci() and report.skipped and not hasattr(report, "wasxfail")
        and not _needs_gpu(item, report)):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (f"skipped under CI=true: {reason}. CI runs every test except those "
                           "needing a GPU; make setup.sh provide what this test needs")
