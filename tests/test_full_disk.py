"""A real full disk: a 256 KiB tmpfs mounted in a private mount namespace (`unshare -rm`, so no root
and nothing left mounted), already filled, under the outputs of `meshlm report` and `meshlm eval`.
An earlier result there stays whole, no temp file is left, and the message names the path and the
free space of that filesystem (bytes), not another one's. tests/faultkit.py covers the same faults
by monkeypatching, for every command; this proves the writers against the kernel's ENOSPC."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from faultkit import ROOT, build_world

SCRIPT = r"""
mount -t tmpfs -o size=256k tmpfs "$DISK" || exit 99
printf 'an earlier report\n' > "$DISK/r.html"
printf '{"earlier": true}\n' > "$DISK/eval.json"
head -c 1048576 /dev/zero > "$DISK/fill" 2>/dev/null
"$PY" -m meshlm.cli report "$RUN" --out "$DISK/r.html" > "$OUT/report.out" 2> "$OUT/report.err"
echo $? > "$OUT/report.rc"
"$PY" -m meshlm.cli eval "$RUN" --tasks none --loops none --limit 2 --out "$DISK/eval.json" \
    > "$OUT/eval.out" 2> "$OUT/eval.err"
echo $? > "$OUT/eval.rc"
cp "$DISK/r.html" "$DISK/eval.json" "$OUT/"
ls -A "$DISK" > "$OUT/listing"
"""


def _namespaces_work(tmp: Path) -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c",
                            f"mount -t tmpfs -o size=64k tmpfs {tmp}"],
                           capture_output=True)
    return probe.returncode == 0


def test_a_full_disk_keeps_earlier_results_and_names_its_own_free_space(tmp_path):
    (tmp_path / "disk").mkdir()
    if not _namespaces_work(tmp_path / "disk"):
        pytest.skip("cannot mount a tmpfs in a user namespace here (unshare -rm)")
    world = build_world(tmp_path / "world")
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "HOME": str(tmp_path),
           "MESHLM_CACHE": str(tmp_path / "cache"), "DISK": str(tmp_path / "disk"),
           "OUT": str(tmp_path),
           "PY": sys.executable, "RUN": str(world["run"])}
    # the report needs a result to show: one small evaluation, written outside the full disk
    subprocess.run([sys.executable, "-m", "meshlm.cli", "eval", str(world["run"]), "--tasks",
                    "none", "--loops",
                    "none", "--limit", "2", "--dtype", "fp32"], env=env, check=True,
                   capture_output=True)
    done = subprocess.run(["unshare", "-rm", "sh", "-c", SCRIPT], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    read = lambda name: (tmp_path / name).read_text()  # noqa: E731
    assert read("r.html") == "an earlier report\n" and read("eval.json") == '{"earlier": true}\n'
    assert read("listing").split() == ["eval.json", "fill", "r.html"]  # no temp file left behind
    report = [line for line in read("report.err").splitlines()
              if not line.startswith("meshlm report: note:")]
    # the page's notes aside, one line
    assert read("report.rc").strip() == "1" and len(report) == 1, report
    assert re.fullmatch(rf"meshlm report: error: writing {tmp_path}/disk/r.html: no space left on "
                        r"device \(\d+ B free\); free some space or choose another folder",
                        report[0]), report
    evaluation = read("eval.err").strip().splitlines()
    # refused before any compute
    assert read("eval.rc").strip() == "2" and not read("eval.out"), evaluation
    assert re.fullmatch(rf"meshlm eval: error: output folder {tmp_path}/disk: no space left on "
                        r"device \(\d+ B free\); free some space or choose another folder",
                        evaluation[-1]), evaluation
