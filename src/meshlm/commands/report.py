"""`meshlm report RUN…`: one self-contained HTML page comparing runs (see meshlm.analysis.report).

    meshlm eval runs/small-mesh && meshlm probe runs/small-mesh      # for each run, then:
    meshlm report runs/small-mesh runs/small-base --out report.html --figures figures/

--figures DIR must be new or empty, or an earlier report's figures replaced with --overwrite
(meshlm.outputs).
"""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="run folders holding eval.json and/or probe/probe.json")
    p.add_argument("--out", default="report.html", help="HTML file to write (default report.html)")
    p.add_argument("--title", default="meshlm report", help="page title")
    p.add_argument("--figures", metavar="DIR",
                   help="also save the page's figures in DIR as PNG, SVG and PDF files (a new or "
                        "empty folder, or an earlier report's with --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the figures of an earlier `meshlm report` in --figures DIR")


def run(args: argparse.Namespace) -> int:
    import sys

    from meshlm import outputs
    from meshlm.analysis.report import write_report

    def note(message: str) -> None:  # what a run lacks: on stderr, beside the page's notes
        print(f"meshlm report: note: {message}", file=sys.stderr)

    if args.figures:  # before any work
        outputs.claim(args.figures, "report", args.overwrite, args.runs, "--figures")
    path = write_report(args.runs, args.out, args.title, args.figures, note=note)
    if args.figures:
        outputs.mark(args.figures, "report")
    print(f"report: {path} ({path.stat().st_size / 1024:.0f} KiB)")
    return 0
