#!/usr/bin/env bash
# Sets up (or refreshes) meshlm's virtual environment in .venv. Safe to run again: it is quick when
# everything is already installed. torch is pinned through constraints.txt in every install path.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -c constraints.txt -e '.[dev]'
