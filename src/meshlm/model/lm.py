"""The one meshlm language model: embed → prelude → loop(cores, scheme) → coda → head.

    x ──embed_in (×√d)──> e ──prelude──> p ──scheme.begin──> h⁰
                                                              │
                     ┌────────────────────────────────────────┘
                     ▼            for t in 0 … n_steps−1 (core = cores[schedule[t]]):
                    h^t ──core──> u^t ──scheme.update(t, h^t, u^t)──> h^{t+1}
                                                              │
    logits <──embed_out── final norm <──coda── h^K <─────────┘

Every scheme (vanilla, base, residual, anchors, mixes, MeSH) runs through this same loop; only
`scheme.begin` and `scheme.update` differ (meshlm.model.schemes, meshlm.model.memory). Vanilla is a
spec whose cores each run once. Every backbone (GPT-NeoX, Llama, OLMoE MoE: meshlm.backbones) runs
through it too; only the layers and the final norm differ. The model knows nothing of training,
data, files or devices.

Tied embeddings (`tie_embeddings`): there is no `embed_out`; the output layer is `embed_in.weight`
(the unscaled table: the √d scale applies to the input side only).

Mixture-of-experts layers report their router logits (one (B·T, E) tensor per layer call, so a
looped core contributes one per pass); the load-balancing and z-losses computed from them are
returned in `LMOutput` and, in training mode, added to `loss` with `aux_loss_weight` /
`z_loss_weight`. In eval mode `loss` is the plain next-token cross-entropy, so validation perplexity
is comparable across backbones.

A forward is three stages, `enter` (embed, prelude, h⁰) → `advance` (loop steps) → `readout` (coda,
head), sharing one `LoopRun` (meshlm.model.run, which joins and stacks runs); self-speculative
decoding (meshlm.generate.speculative) stops `advance` early to draft and resumes it later to
verify.

Truncated backprop through depth (`backprop_loops=k`, Huginn's recipe): the first K − k loop steps
run without autograd, so their activations are never kept; the state they produce enters step K − k
as a constant, while e, p and h⁰ (injected into later steps by the scheme) keep their gradients.
Peak memory then follows k, not K (benchmarks/elastic.py).

Per-token adaptive exit (`exit=ExitRule.parse("state:0.05")`, meshlm.model.exit; the model takes
the rule typed, never as text): the same loop runs only the still-active tokens' core passes and
stops when none is left; exited tokens' keys/values are copied forward.

Per-loop LoRA (`loop_lora_rank`, meshlm.model.loop_lora): before each core pass the loop selects
that pass's low-rank delta in the core's Linears; every path above (exit, speculation, the cache)
runs through `advance`, so each gets the right delta per step.

Incremental decoding: pass a `cache` (meshlm.model.kv_cache) and only the new tokens. Each unrolled
layer gets its own cache slot; the scheme state (MeSH buffer, anchors) is per token and needs none.
With a cache, `padding_mask` covers the cached tokens too (B, T_past + T), as in Hugging Face's
`generate()`. Default positions count real tokens only (cumsum of `padding_mask` − 1), so a
left-padded row gets the same positions as the unpadded prompt.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.backbones import BACKBONES
from meshlm.config import ModelConfig
from meshlm.errors import ConfigError
from meshlm.model.exit import NO_EXIT, ExitRule, ExitTracker, NoExit
from meshlm.model.init import init_weights
from meshlm.model.kv_cache import LayerCache, slot_offsets
from meshlm.model.layers import Rope, RotaryEmbedding, at_least_fp32, attention_mask_from_padding
from meshlm.model.loop_lora import attach as attach_loop_lora
from meshlm.model.loop_lora import select_pass
from meshlm.model.moe import router_losses
from meshlm.model.reveal import Reveal, Revealing
from meshlm.model.run import LoopRun, Stages
from meshlm.model.schemes import LoopContext, build_scheme
from meshlm.model.stack import Stack


@dataclass
class LMOutput:
    logits: torch.Tensor  # (B, T, vocab)
    loss: torch.Tensor | None = None  # the objective: lm_loss (+ weighted MoE losses in training
    # mode)
    stages: Stages | None = None  # only with return_states=True
    lm_loss: torch.Tensor | None = None  # mean next-token cross-entropy over targets !=
    # ignore_index
    aux_loss: torch.Tensor | None = None  # MoE load-balancing loss, unweighted (None without MoE
    # layers)
    z_loss: torch.Tensor | None = None  # MoE router z-loss, unweighted
    exit_loops: torch.Tensor | None = None  # with exit: (B, T) loop steps each token ran
    exit_probes: torch.Tensor | None = None  # with exit: (B, T) coda + head probes per token (kl)


class MeshLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        layout = cfg.layout
        self.embed_in = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.prelude = Stack(cfg, layout.prelude)
        self.cores = nn.ModuleList(Stack(cfg, n) for n in layout.cores)
        if cfg.loop_lora_rank:
            # per-loop LoRA: one delta per pass of each shared core
            attach_loop_lora(self.cores, cfg)
        self.coda = Stack(cfg, layout.coda)
        self.scheme = build_scheme(cfg)
        # LayerNorm or RMSNorm, as its layers untied as Pythia and OLMoE; tied: the output layer is
        # embed_in.weight
        self.final_layer_norm = BACKBONES[cfg.backbone].norm(cfg)
        self.embed_out = (None if cfg.tie_embeddings
                          else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False))
        self.rotary = RotaryEmbedding(cfg.rotary_dims, cfg.rotary_base)
        self.embed_scale = math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0
        init_weights(self, cfg)

    def schedule(self, loops: int | None = None) -> tuple[int, ...]:
        """Core index per step. `loops` overrides K for a single-core model (e.g. loss vs.
        depth)."""
        layout = self.config.layout
        if loops is None:
            return layout.schedule
        if len(layout.cores) != 1 or loops < 1:
            raise ConfigError(f"loops={loops} needs a single-core spec and loops >= 1 (spec "
                              f"{self.config.spec!r})")
        return (0,) * loops

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T) token ids
        targets: torch.Tensor | None = None,  # (B, T) next-token ids, ignore_index where no loss
        padding_mask: torch.Tensor | None = None,  # (B, T_past + T) 1 = real token, 0 = padding
        # (B, T) or (1, T); default: see the module docstring
        position_ids: torch.Tensor | None = None,
        return_states: bool = False,
        loops: int | None = None,
        ignore_index: int = -100,
        # KV cache, updated in place; holds T_past tokens before the call
        cache: LayerCache | None = None,
        # truncated backprop: only the last k loop steps keep autograd state
        backprop_loops: int | None = None,
        # per-token adaptive exit, e.g. ExitRule.parse("state:0.05") (meshlm.model.exit)
        exit: ExitRule | None = None,
        # training: each row's loop sees a partial input for its first steps (meshlm.model.reveal)
        reveal: Reveal | None = None,
    ) -> LMOutput:
        schedule = self.schedule(loops)
        run = self.start(input_ids, padding_mask, cache, exit, position_ids, return_states,
                         backprop_loops, reveal)
        self.advance(run, schedule, backprop_loops=backprop_loops)
        out = LMOutput(logits=self.readout(run, schedule), stages=run.stages,
                       exit_loops=run.track.loops, exit_probes=run.track.probes)
        return self._losses(out, targets, ignore_index, run.routed, padding_mask)

    # -- the three stages of a forward; speculative decoding (meshlm.generate.speculative) runs them
    # separately
    def enter(self, input_ids: torch.Tensor, padding_mask: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None, cache: LayerCache | None = None,
              return_states: bool = False) -> LoopRun:
        """Embed and run the prelude: a run standing at loop step 0 with h = h⁰."""
        past = 0 if cache is None else cache.get_seq_length()  # before the prelude writes to it
        e, rope, mask = self._prepare(input_ids, padding_mask, position_ids, cache)
        # routed: MoE router logits of every layer call, in order
        ctx, routed = LoopContext(e=e), []
        p = self.prelude(e, rope, mask, cache, 0, routed)  # the prelude's cache slots come first
        h = self.scheme.begin(ctx, p)
        stages = Stages(embeddings=e, prelude=p, states=[h]) if return_states else None
        return LoopRun(h=h, ctx=ctx, rope=rope, mask=mask, cache=cache, routed=routed,
                       stages=stages, past=past, track=NO_EXIT)

    def start(self, input_ids: torch.Tensor, padding_mask: torch.Tensor | None = None,
              cache: LayerCache | None = None, exit: ExitRule | None = None,
              position_ids: torch.Tensor | None = None, return_states: bool = False,
              backprop_loops: int | None = None, reveal: Reveal | None = None) -> LoopRun:
        """`enter` with the exit tracker (or a delayed reveal) in place: a forward standing at loop
        step 0 that `advance` runs (whole, or a few loop steps per call: serve slices a deep
        request's step this way) and `readout` ends, computing what `forward` computes."""
        run = self.enter(input_ids, padding_mask, position_ids, cache, return_states)
        run.track = self._tracker(exit, run, padding_mask, run.past, backprop_loops)
        if reveal is not None:
            self._reveal(run, reveal, padding_mask, position_ids)
        return run

    def _reveal(self, run: LoopRun, reveal: Reveal, padding_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None) -> None:
        """Start each row from the early input's h⁰ where it is hidden, and keep both inputs'
        contexts for `advance` to choose from per step (meshlm.model.reveal)."""
        if not self.scheme.reinjects:
            raise ConfigError(f"reveal needs a scheme that re-injects its input at every loop step "
                              f"(anchor, anchor-emb, residual+anchor, the mixes); "
                              f"{self.config.scheme!r} reads it only before the loop")
        if run.cache is not None or run.track is not NO_EXIT:
            raise ConfigError("reveal is a training setting: it cannot be combined with a cache "
                              "or exit; drop one of them")
        early = self.enter(reveal.early_ids, padding_mask, position_ids)
        run.revealing = Revealing(reveal, run.ctx, early.ctx)
        run.h = run.revealing.start(run.h, early.h)
        if run.stages is not None:
            run.stages.states[0] = run.h

    def advance(self, run: LoopRun, schedule: tuple[int, ...], stop: int | None = None,
                backprop_loops: int | None = None) -> LoopRun:
        """The one loop of every scheme, in place: h^{t+1} = scheme.update(t, h^t, core(h^t)) for t
        = run.step … stop−1 (default, or past it: to the end of `schedule`). Under exit only the
        still-active tokens' core passes run, and the loop ends when none is left."""
        _, step_slots, coda_slot, _ = slot_offsets(self.config.layout, schedule)
        # earlier steps: no autograd
        first_grad_step = len(schedule) - backprop_loops if backprop_loops else 0
        track = run.track  # NO_EXIT without exit: every token computed, nothing probed
        if run.step == 0:
            self._probe(track, run.h, coda_slot, 0)  # a probing criterion compares step 1 with h⁰
        for step in range(run.step, len(schedule) if stop is None else min(stop, len(schedule))):
            if step == first_grad_step > 0 and torch.is_grad_enabled():
                # MeSH: fold the no-grad steps' values, memory follows k
                self.scheme.truncate(run.ctx)
            with torch.set_grad_enabled(torch.is_grad_enabled() and step >= first_grad_step):
                x, r, m, kv, routed = track.step_inputs(run, step_slots[step])
                core = self.cores[schedule[step]]
                # this pass's delta: the core's passes before this step
                if self.config.loop_lora_rank:
                    select_pass(core, schedule[:step].count(schedule[step]))
                u = core(x, r, m, kv, step_slots[step], routed)
                ctx = run.ctx if run.revealing is None else run.revealing.context(step)
                h = self.scheme.update(step, run.h, track.merge(u, run.h), ctx)
            run.step = step + 1
            if run.stages is not None:
                run.stages.core_outputs.append(u)
                run.stages.states.append(h)
            self._probe(track, h, coda_slot, step + 1)
            run.h = track.advance(run.h, h)
            if track.finished:  # every token exited: later steps' cache slots get their K/V copied
                probes = [self._probe_slot(coda_slot, j)
                          for j in range(step + 2, len(schedule) + 1)]
                track.skip(step_slots[step + 1:], probes)
                run.step = len(schedule)
                break
        return run

    def readout(self, run: LoopRun, schedule: tuple[int, ...],
                last: int | None = None) -> torch.Tensor:
        """Coda and head on the current state: (B, T, vocab) logits, or (B, last, vocab) for the
        last `last` positions only (the coda still runs on all T: they attend to the others). The
        coda uses `schedule`'s coda slots whatever step the run stands at (a speculative draft exits
        early into the full model's coda slots)."""
        if run.track.logits is not None:  # a probing exit: each token's probe where it exited
            logits = run.track.final_logits()
            return logits if last is None else logits[:, -last:]
        coda_slot = slot_offsets(self.config.layout, schedule)[2]
        y = self.coda(run.h, run.rope, run.mask, run.cache, coda_slot, run.routed)
        if run.stages is not None:
            run.stages.coda, run.stages.routing, run.stages.router_logits = (y, run.ctx.routing,
                                                                             run.routed)
        return self.head(y if last is None else y[:, -last:])  # (B, T or last, vocab)

    def head(self, y: torch.Tensor) -> torch.Tensor:
        """Final norm and output layer: (…, d) -> (…, vocab). An untied head is called as a module,
        so a quantized one (meshlm.quant) runs its own kernel."""
        y = self.final_layer_norm(y)
        return F.linear(y, self.embed_in.weight) if self.embed_out is None else self.embed_out(y)

    # -- per-token adaptive exit (meshlm.model.exit) -----------------------------------------------
    def _tracker(self, exit: ExitRule | None, run: LoopRun, padding_mask: torch.Tensor | None,
                 past: int, backprop_loops: int | None) -> ExitTracker | NoExit:
        if exit is None:
            return NO_EXIT
        if run.stages is not None or backprop_loops:
            raise ConfigError("exit is an inference setting: it cannot be combined with "
                              "return_states or backprop_loops; drop one of them")
        if not isinstance(exit, ExitRule):  # text is parsed once, where it comes in
            raise TypeError(f"exit={exit!r}: pass an ExitRule (meshlm.model.exit.ExitRule.parse"
                            f"({str(exit)!r})); the model takes settings typed, not as text")
        return ExitTracker(exit, run.h, run.rope, run.mask, padding_mask, run.cache, past)

    def _probe_slot(self, coda_slot: int, j: int) -> int:
        """Probing exit: the coda probe of state h^j has its own cache slots (the first ones are the
        coda's own)."""
        return coda_slot + j * self.config.layout.coda

    def _probe(self, track: ExitTracker | NoExit, h: torch.Tensor, coda_slot: int, j: int) -> None:
        """If the criterion probes: coda + head on the computed tokens' state h^j, handed to the
        tracker."""
        if not track.probing:
            return
        slot = self._probe_slot(coda_slot, j)
        x, r, m, kv = track.inputs(h, "probe", slot)
        track.probe(self.head(self.coda(x, r, m, kv, slot, [])))

    def _losses(self, out: LMOutput, targets: torch.Tensor | None, ignore_index: int,
                routed: list[torch.Tensor], padding_mask: torch.Tensor | None) -> LMOutput:
        """Fill lm_loss, the MoE losses (if any layer routed) and the objective `loss`."""
        cfg = self.config
        if routed:
            # (B, T)
            token_mask = None if padding_mask is None else padding_mask[:, -out.logits.shape[1]:]
            out.aux_loss, out.z_loss = router_losses(routed, cfg.n_experts, cfg.top_k, token_mask)
        if targets is not None:
            logits = at_least_fp32(out.logits).flatten(0, 1)  # (B·T, vocab)
            out.lm_loss = out.loss = F.cross_entropy(logits, targets.flatten(),
                                                     ignore_index=ignore_index)
            if routed and self.training:
                out.loss = (out.loss + cfg.aux_loss_weight * out.aux_loss
                            + cfg.z_loss_weight * out.z_loss)
        return out

    @property
    def output_weight(self) -> torch.Tensor:
        """(vocab, d): embed_out's weight, or the input embedding table when tied."""
        return self.embed_in.weight if self.embed_out is None else self.embed_out.weight

    def _prepare(self, input_ids: torch.Tensor, padding_mask: torch.Tensor | None,
                 position_ids: torch.Tensor | None, cache: LayerCache | None
                 ) -> tuple[torch.Tensor, Rope, torch.Tensor | None]:
        """Embeddings e (B, T, d), rotary tables for the positions, and the attention mask (or
        None)."""
        past = 0 if cache is None else cache.get_seq_length()
        e = self.embed_in(input_ids) * self.embed_scale  # (B, T, d)
        return (e,
                *self.attention_inputs(input_ids.shape, past, padding_mask, position_ids, e.dtype))

    def attention_inputs(self, shape: tuple[int, int], past: int, padding_mask: torch.Tensor | None,
                         position_ids: torch.Tensor | None, dtype: torch.dtype
                         ) -> tuple[Rope, torch.Tensor | None]:
        """Rotary tables and attention mask for T = shape[1] new tokens after `past` cached ones."""
        b, t = shape
        device = self.embed_in.weight.device
        if past + t > self.config.context_length:
            raise ConfigError(f"sequence of {past + t} tokens exceeds the model's "
                              f"context_length={self.config.context_length}; truncate the input or "
                              "use a longer-context config")
        if padding_mask is not None and padding_mask.shape[-1] != past + t:
            raise ConfigError(f"padding_mask covers {padding_mask.shape[-1]} tokens but the cache "
                              f"holds {past} and the input {t}; pass a mask over all {past + t} "
                              "tokens")
        if position_ids is None:
            position_ids = default_positions(padding_mask, past, t, device)
        rope = self.rotary(position_ids, dtype)
        # several new tokens after a past: causal w.r.t. it
        if padding_mask is None and past > 0 and t > 1:
            padding_mask = torch.ones(b, past + t, dtype=torch.long, device=device)
        mask = None if padding_mask is None else attention_mask_from_padding(padding_mask, past)
        return rope, mask


def default_positions(padding_mask: torch.Tensor | None, past: int, t: int,
                      device: torch.device) -> torch.Tensor:
    """Positions of the T new tokens: past … past+T−1, or with a padding mask, real tokens counted
    from 0."""
    if padding_mask is None:
        return torch.arange(past, past + t, device=device)[None]  # (1, T), broadcast over the batch
    return (padding_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]  # (B, T); left pads sit at 0
