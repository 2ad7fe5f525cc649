"""The unigram baseline a trained LM must beat: every token predicted by its training-split
frequency."""
from __future__ import annotations

import math

import numpy as np

from meshlm.data.examples import no_label

# count at most this many tokens of each split (a prefix): bounded time and memory
MAX_TOKENS = 50_000_000


def unigram_perplexity(train_data, val_data, vocab_size: int) -> float:
    """exp(cross-entropy of the validation tokens under add-one-smoothed training unigram
    frequencies). On task data both sides count what the loss scores: the answer tokens, or the
    labels of labelled data."""
    counts = np.bincount(_scored(train_data), minlength=vocab_size)
    log_p = np.log(counts + 1.0) - math.log(counts.sum() + vocab_size)  # (vocab,)
    return float(math.exp(-log_p[_scored(val_data)].mean()))


def _scored(data) -> np.ndarray:
    """A prefix of the split's scored targets: its tokens, those under the answer mask when it has
    one, or its labels when it is labelled."""
    stop = min(data.num_tokens, MAX_TOKENS)
    if data.labels is not None:
        labels = data.tokens(0, stop, data.labels)
        return labels[labels != no_label(np.dtype(data.manifest["dtype"]))]
    tokens = data.tokens(0, stop)
    return tokens if data.masks is None else tokens[data.tokens(0, stop, data.masks) > 0]
