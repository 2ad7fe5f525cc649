"""A MeshLM as an lm-evaluation-harness model: loglikelihoods computed in batches, here, from
logits.

lm-eval hands over (context, continuation) strings; we tokenise them as its HF adapter (HFLM) does,
so scores are comparable with published lm-eval numbers:
- trailing whitespace of the context moves to the continuation; the pair is encoded whole and split
  at the context's token count (so a merge across the boundary counts for the continuation);
- an empty context is replaced by the end-of-text token (Pythia's convention: EOS also opens
  documents);
- sequences longer than the model's context are LEFT-truncated to context_length + 1 tokens.

Batching: requests are sorted by length (longest first, so the first batch shows the peak memory),
packed up to `batch_tokens` padded tokens, right-padded with the pad id and run without an attention
mask: the model is causal and everything is per token (MeSH included), so padding after a sequence
cannot change its logits. Results come back in the caller's order.

Generation (`generate_until`, lm-eval's generative tasks) runs meshlm's own cached decoding
(meshlm.generate.stream: the looped KV cache, `loops`, per-token `exit`, lossless `speculate`) and
follows HFLM's rules through lm-eval's own helpers: requests grouped by their generation settings,
longest context first; the context left-truncated to leave room for `max_gen_toks`; the stop strings
plus the decoded EOS; each text cut at the first stop string. A batch stops once every row has ended
(EOS or a stop string).

`continuation_logprob` is the unbatched reference the tests compare against (it goes through the
model's own cross-entropy loss, not the gather used here).
"""
from __future__ import annotations

import json
import time

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from meshlm.errors import ConfigError
from meshlm.generate import Sampling, stream
from meshlm.generate.speculative import Speculation
from meshlm.model.exit import ExitRule

Pair = tuple[list[int], list[int]]  # (context ids, continuation ids)


class Progress:
    """A line every `every_s` seconds and one at the end, so a long few-shot setting is not minutes
    of silence."""

    def __init__(self, log, total: int, what: str, every_s: float = 30.0):
        self.log, self.total, self.what, self.every_s = log, total, what, every_s
        self.count, self.start = 0, time.monotonic()
        self.last = self.start

    def add(self, n: int) -> None:
        self.count += n
        if self.log is not None and time.monotonic() - self.last >= self.every_s:
            self.last = time.monotonic()
            self.log(f"    {self.count:,} of {self.total:,} {self.what} "
                     f"({self.last - self.start:.0f} s)")

    def done(self) -> None:
        if self.log is not None and self.total:
            self.log(f"    {self.total:,} {self.what} in {time.monotonic() - self.start:.0f} s")


class MeshLMEval(LM):
    """lm-eval `LM` over a MeshLM and a meshlm TextTokenizer. `loops` evaluates at another loop
    count, `exit` (an ExitRule) lets each token stop looping early; `speculate` (a Speculation)
    decodes generative tasks by lossless self-speculation (the same tokens when greedy)."""

    MAX_GEN_TOKS = 256  # HFLM's default where a task sets no max_gen_toks

    def __init__(self, model, tokenizer, batch_tokens: int = 8192, loops: int | None = None,
                 device: str | torch.device | None = None, exit: ExitRule | None = None,
                 speculate: Speculation | None = None,
                 log=None, every_s: float = 30.0):
        super().__init__()
        # progress lines (lm-eval's own bars are silenced by meshlm eval)
        self.log, self.every_s = log, every_s
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_tokens = batch_tokens
        self.loops, self.exit, self.speculate = loops, exit, speculate
        self.max_length = model.config.context_length
        self.torch_device = torch.device(device) if device else next(model.parameters()).device

    # -- tokenisation (as HFLM) --------------------------------------------------------------------
    def encode_pair(self, context: str, continuation: str) -> Pair:
        if not context:
            return [self.tokenizer.eos_id], self.tokenizer.encode(continuation)
        n_space = len(context) - len(context.rstrip())
        if n_space:
            context, continuation = context[:-n_space], context[-n_space:] + continuation
        whole = self.tokenizer.encode(context + continuation)
        n_ctx = len(self.tokenizer.encode(context))
        return whole[:n_ctx], whole[n_ctx:]

    # -- lm-eval API -------------------------------------------------------------------------------
    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = [self.encode_pair(*req.args) for req in requests]
        progress = Progress(self.log, len(pairs), "loglikelihood requests", self.every_s)
        results = self.score(pairs, progress)
        progress.done()
        for req, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", req.args, result)
        return results

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Whole-document log-probability in disjoint windows of the full context (lm-eval's rolling
        scheme)."""
        out = []
        for req in requests:
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tokenizer.encode(req.args[0]), prefix_token=self.tokenizer.eos_id,
                max_seq_len=self.max_length, context_len=1)]
            total = sum(logprob
                        for logprob, _ in self.score([(list(c), list(t)) for c, t in windows]))
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
            out.append(total)
        return out

    def generate_until(self, requests) -> list[str]:
        """Each request's continuation (see the module docstring), in the caller's order."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):  # one group per distinct generation setting
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out: list[str | None] = [None] * len(requests)
        progress = Progress(self.log, len(requests), "generate_until requests", self.every_s)
        for members in groups.values():
            settings = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self.MAX_GEN_TOKS)
            eos = self.tokenizer.decode([self.tokenizer.eos_id])
            until, n_new = handle_stop_sequences(settings.pop("until", None),
                                                 eos), settings.pop("max_gen_toks")
            room = self.max_length - n_new  # context tokens kept (the left end is cut, as HFLM)
            if room < 1:
                raise ConfigError(f"the task asks for max_gen_toks={n_new}, which leaves no room "
                                  f"for a prompt in context_length={self.max_length}; lower "
                                  "max_gen_toks in its generation_kwargs")
            prompts = {i: self.tokenizer.encode(requests[i].args[0])[-room:]
                       or [self.tokenizer.eos_id]
                       for i in members}
            order = sorted(members, key=lambda i: -len(prompts[i]))
            per_batch = max(1, self.batch_tokens // (len(prompts[order[0]]) + n_new))
            for start in range(0, len(order), per_batch):
                batch = order[start:start + per_batch]
                texts = self._generate([prompts[i] for i in batch], until, n_new, settings)
                for i, text in zip(batch, texts):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                progress.add(len(batch))
        progress.done()
        return out

    def _generate(self, prompts: list[list[int]], until: list[str], n_new: int,
                  settings: dict) -> list[str]:
        """Decode a batch until every row has ended (EOS, a stop string or n_new tokens); texts cut
        at the stop."""
        sampled = bool(settings.get("do_sample"))
        s = Sampling(max_new_tokens=n_new,
                     temperature=float(settings.get("temperature") or 0.0) if sampled else 0.0,
                     top_k=int(settings.get("top_k") or 0),
                     top_p=float(settings.get("top_p") or 1.0))
        made: list[list[int]] = [[] for _ in prompts]
        ended = [False] * len(prompts)
        steps = stream(self.model, prompts, s, eos_id=self.tokenizer.eos_id,
                       pad_id=self.tokenizer.pad_id,
                       loops=self.loops, exit=self.exit, speculate=self.speculate)
        for tokens in steps:  # (B,) next tokens
            for row, token in enumerate(tokens.tolist()):
                if ended[row]:
                    continue
                if token == self.tokenizer.eos_id:
                    ended[row] = True
                    continue
                made[row].append(token)
                ended[row] = any(t and t in self._text(made[row]) for t in until)
            if all(ended):
                break
        return [postprocess_generated_text(self._text(ids), until, None) for ids in made]

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.hf.decode(ids, skip_special_tokens=True)  # as HFLM's tok_decode

    # -- batched scoring ---------------------------------------------------------------------------
    def score(self, pairs: list[Pair],
              progress: Progress | None = None) -> list[tuple[float, bool]]:
        """(sum of continuation log-probs, whether greedy decoding reproduces it) for each pair."""
        windows = [self._window(ctx, cont) for ctx, cont in pairs]
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
        results: list[tuple[float, bool] | None] = [None] * len(windows)
        for batch in self._batches(order, windows):
            for i, result in zip(batch, self._score_batch([windows[i] for i in batch])):
                results[i] = result
            if progress is not None:
                progress.add(len(batch))
        return results

    def _window(self, ctx: list[int], cont: list[int]) -> tuple[list[int], int]:
        """Input+target tokens left-truncated to context_length + 1, and how many trailing ones to
        score."""
        tokens = (ctx + cont)[-(self.max_length + 1):]
        return tokens, min(len(cont), len(tokens) - 1)

    def _batches(self, order: list[int], windows) -> list[list[int]]:
        batches, current = [], []
        for i in order:  # longest first: the first member's length is the batch's padded length
            if (current
                and (len(current) + 1) * (len(windows[current[0]][0]) - 1) > self.batch_tokens):
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
    """log p(cont | ctx), one sequence, through the model's own loss (the reference for
    `MeshLMEval.score`)."""
    tokens = (ctx + cont)[-(model.config.context_length + 1):]
    n = min(len(cont), len(tokens) - 1)
    ids = torch.tensor(tokens, device=next(model.parameters()).device)[None]  # (1, T + 1)
    targets = ids[:, 1:].clone()
    targets[:, :targets.shape[1] - n] = -100  # score only the continuation
    loss = model(ids[:, :-1], targets=targets, loops=loops).loss  # mean over the n scored tokens
    return -loss.item() * n
