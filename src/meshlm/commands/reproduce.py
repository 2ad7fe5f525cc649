"""`meshlm reproduce`: run a study (variants × seeds: train, eval, probe, report) from one YAML
file.

    meshlm reproduce --quick                                   # configs/studies/quick.yaml (~13 min
                                                                 on 2 CPUs)
    meshlm reproduce configs/studies/cpu-12layer.yaml          # the CPU-scale study of
                                                                 docs/results.md
    meshlm reproduce configs/studies/paper-410m.yaml --plan    # print runs, tokens, FLOPs,
                                                                 GPU-hours; exit
    meshlm reproduce STUDY.yaml train.steps=50                 # dotted overrides for every run
    meshlm reproduce STUDY.yaml --jobs 8                       # 8 runs at a time (many cores, or
                                                                 GPUs)
    meshlm reproduce studies/reasoning.yaml --only 'chase-*'   # part of a study: variants by name
                                                                 or pattern
    meshlm reproduce studies/reasoning.yaml train.steps=6000 --only chase-mesh-sampled --seeds 0

Study files and the train configs they name are paths, or names of the configs shipped inside meshlm
(meshlm/configs: `studies/…`, `cpu/…`, `paper/…`; the repository's configs/ links there), so this
works from any directory and from an installed wheel.

Interrupt it and run it again: finished runs are skipped, a half-trained run resumes.
"""
from __future__ import annotations

import argparse

from meshlm.commands.eval import int_list


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("study", nargs="?",
                   help="study YAML: a path, or a shipped study such as studies/cpu-12layer.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted train-config overrides for every run")
    p.add_argument("--quick", action="store_true",
                   help="the quick study: configs/studies/quick.yaml")
    p.add_argument("--plan", action="store_true",
                   help="print the plan with token/FLOP/GPU-hour estimates and exit")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="runs at a time (default 1); each gets cores/N threads, and with several "
                        "GPUs its own GPU")
    p.add_argument("--only", metavar="VARIANTS",
                   help="run only these variants: comma-separated names or patterns, e.g. "
                        "'chase-*,dag-mesh-*'")
    p.add_argument("--seeds", type=int_list, metavar="S,S",
                   help="these seeds for every variant instead of the study file's, e.g. 0 or 0,1")
    p.add_argument("--keep-going", action="store_true",
                   help="after a failed run, start the remaining runs anyway (the failure is "
                        "still reported)")


def run(args: argparse.Namespace) -> int:
    from meshlm.analysis.study import load_study, plan_table
    from meshlm.analysis.study_runner import execute
    from meshlm.errors import ConfigError

    # `--quick train.steps=50`: an override, not a file
    if args.quick and args.study and "=" in args.study:
        args.overrides, args.study = [args.study, *args.overrides], None
    if args.quick == bool(args.study):
        raise ConfigError("pass a study file or --quick (not both); examples are in "
                          "configs/studies/")
    if args.jobs < 1:
        raise ConfigError(f"--jobs {args.jobs}: the number of runs at a time must be >= 1")
    # shipped, or a path
    study = load_study("studies/quick.yaml" if args.quick else args.study, args.overrides,
                       only=args.only, seeds=args.seeds)
    print(plan_table(study), flush=True)
    if args.plan:
        return 0
    execute(study, log=lambda message: print(message, flush=True), jobs=args.jobs,
            keep_going=args.keep_going)
    print(f"results: {study.dir / 'results.md'} and {study.dir / 'report.html'}")
    return 0
