"""A MeshLM as an lm-evaluation-harness model: loglikelihoods computed in batches, here, from logits.

lm-eval hands over (context, continuation) strings; we tokenise them as its HF adapter (HFLM) does, so
scores are comparable with published lm-eval numbers:
- trailing whitespace of the context moves to the continuation; the pair is encoded whole and split at the
  context's token count (so a merge across the boundary counts for the continuation);
- an empty context is replaced by the end-of-text token (Pythia's convention: EOS also opens documents);
- sequences longer than the model's context are LEFT-truncated to context_length + 1 tokens.

Batching: requests are sorted by length (longest first, so the first batch shows the peak memory), packed
up to `batch_tokens` padded tokens, right-padded with the pad id and run without an attention mask: the
model is causal and everything is per token (MeSH included), so padding after a sequence cannot change its
logits. Results come back in the caller's order.

`continuation_logprob` is the unbatched reference the tests compare against (it goes through the model's
own cross-entropy loss, not the gather used here).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

Pair = tuple[list[int], list[int]]  # (context ids, continuation ids)


class MeshLMEval(LM):
    """lm-eval `LM` over a MeshLM and a meshlm TextTokenizer. `loops` evaluates at another loop count."""

    def __init__(self, model, tokenizer, batch_tokens: int = 8192, loops: int | None = None,
                 device: str | torch.device | None = None):
        super().__init__()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_tokens = batch_tokens
        self.loops = loops
        self.max_length = model.config.context_length
        self.torch_device = torch.device(device) if device else next(model.parameters()).device

    # -- tokenisation (as HFLM) ---------------------------------------------------------------------------
    def encode_pair(self, context: str, continuation: str) -> Pair:
        if not context:
            return [self.tokenizer.eos_id], self.tokenizer.encode(continuation)
        n_space = len(context) - len(context.rstrip())
        if n_space:
            context, continuation = context[:-n_space], context[-n_space:] + continuation
        whole = self.tokenizer.encode(context + continuation)
        n_ctx = len(self.tokenizer.encode(context))
        return whole[:n_ctx], whole[n_ctx:]

    # -- lm-eval API --------------------------------------------------------------------------------------
    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = [self.encode_pair(*req.args) for req in requests]
        results = self.score(pairs)
        for req, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, result)
        return results

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Whole-document log-probability in disjoint windows of the full context (lm-eval's rolling scheme)."""
        out = []
        for req in requests:
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tokenizer.encode(req.args[0]), prefix_token=self.tokenizer.eos_id,
                max_seq_len=self.max_length, context_len=1)]
            total = sum(logprob for logprob, _ in self.score([(list(c), list(t)) for c, t in windows]))
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
            out.append(total)
        return out

    def generate_until(self, requests):
        raise NotImplementedError("meshlm's lm-eval adapter scores loglikelihoods only; the paper's suite needs "
                                  "no generation (use `meshlm generate` for text)")

    # -- batched scoring ----------------------------------------------------------------------------------
    def score(self, pairs: list[Pair]) -> list[tuple[float, bool]]:
        """(sum of continuation log-probs, whether greedy decoding reproduces it) for each pair."""
        windows = [self._window(ctx, cont) for ctx, cont in pairs]
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
        results: list[tuple[float, bool] | None] = [None] * len(windows)
        for batch in self._batches(order, windows):
            for i, result in zip(batch, self._score_batch([windows[i] for i in batch])):
                results[i] = result
        return results

    def _window(self, ctx: list[int], cont: list[int]) -> tuple[list[int], int]:
        """Input+target tokens left-truncated to context_length + 1, and how many trailing ones to score."""
        tokens = (ctx + cont)[-(self.max_length + 1):]
        return tokens, min(len(cont), len(tokens) - 1)

    def _batches(self, order: list[int], windows) -> list[list[int]]:
        batches, current = [], []
        for i in order:  # longest first: the first member's length is the batch's padded length
            if current and (len(current) + 1) * (len(windows[current[0]][0]) - 1) > self.batch_tokens:
                batches.append(current)
                current = []
            current.append(i)
        return batches + ([current] if current else [])

    @torch.no_grad()
    def _score_batch(self, windows: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        length = max(len(tokens) for tokens, _ in windows) - 1
        ids = torch.full((len(windows), length + 1), self.tokenizer.pad_id, dtype=torch.long)
        for row, (tokens, _) in enumerate(windows):
            ids[row, :len(tokens)] = torch.tensor(tokens)
        ids = ids.to(self.torch_device)
        logits = self.model(ids[:, :-1], loops=self.loops).logits  # (b, length, vocab)
        out = []
        for row, (tokens, n) in enumerate(windows):
            end = len(tokens) - 1  # positions [end - n, end) predict the continuation
            logp = F.log_softmax(logits[row, end - n:end].float(), dim=-1)  # (n, vocab)
            target = ids[row, end - n + 1:end + 1]  # (n,)
            picked = logp.gather(-1, target[:, None]).squeeze(-1)
            out.append((picked.sum().item(), bool((logp.argmax(-1) == target).all())))
        return out


@torch.no_grad()
def continuation_logprob(model, ctx: list[int], cont: list[int], loops: int | None = None) -> float:
    """log p(cont | ctx), one sequence, through the model's own loss (the reference for `MeshLMEval.score`)."""
    tokens = (ctx + cont)[-(model.config.context_length + 1):]
    n = min(len(cont), len(tokens) - 1)
    ids = torch.tensor(tokens, device=next(model.parameters()).device)[None]  # (1, T + 1)
    targets = ids[:, 1:].clone()
    targets[:, :targets.shape[1] - n] = -100  # score only the continuation
    loss = model(ids[:, :-1], targets=targets, loops=loops).loss  # mean over the n scored tokens
    return -loss.item() * n
