"""Write docs/errors.md: every case of tests/faultkit.py run for real, with the message it gets.

    PYTHONPATH=src python scripts/errors_table.py          # ~2 minutes on 2 CPU cores (three cases
                                                             train)
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from faultkit import CASES, DOC, build_world, message, normalise, row, run_case, table  # noqa: E402


def main() -> int:
    rows, failed = [], []
    with tempfile.TemporaryDirectory() as root:
        world = build_world(Path(root) / "world")
        for case in CASES:
            tmp = Path(root) / case.id
            tmp.mkdir()
            code, _, err = run_case(case, tmp, world)
            shown = normalise(message(case, err), tmp, world)
            if code != case.code or case.needle not in shown or "Traceback" in err:
                failed.append(f"{case.id} ({case.what}): exit {code}, expected {case.code}; "
                              f"{err.strip()[-400:]}")
            rows.append(row(case, shown))
            print(f"{case.id}: {code} {shown[:100]}", flush=True)
    DOC.write_text(table(rows))
    print(f"wrote {DOC} ({len(rows)} cases)")
    for line in failed:
        print("FAILED", line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
