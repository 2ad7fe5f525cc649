"""The unigram baseline a trained LM must beat: every token predicted by its training-split frequency."""
from __future__ import annotations

import math

import numpy as np

MAX_TOKENS = 50_000_000  # count at most this many tokens of each split (a prefix): bounded time and memory


def unigram_perplexity(train_data, val_data, vocab_size: int) -> float:
    """exp(cross-entropy of the validation tokens under add-one-smoothed training unigram frequencies)."""
    counts = np.bincount(train_data.tokens(0, min(train_data.num_tokens, MAX_TOKENS)), minlength=vocab_size)
    log_p = np.log(counts + 1.0) - math.log(counts.sum() + vocab_size)  # (vocab,)
    val = val_data.tokens(0, min(val_data.num_tokens, MAX_TOKENS))
    return float(math.exp(-log_p[val].mean()))
