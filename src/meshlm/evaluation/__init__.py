"""Evaluation: validation perplexity and loss vs. loop count (perplexity), downstream accuracy
through lm-evaluation-harness (downstream, with the MeshLM adapter in harness) and `meshlm eval` as
a function (run), on a model opened by meshlm.loading.

Importing this package switches the Hugging Face Hub off (local files only) and keeps lm-eval's
bootstrap in-process, before any submodule can import lm_eval or datasets (both read these at import
time).
"""
import os

for _key in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "DISABLE_MULTIPROC"):
    os.environ.setdefault(_key, "1")
