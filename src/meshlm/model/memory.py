"""MeSH: Memory-as-State-Highways (arXiv 2510.07739) — the paper's contribution in one file.

A buffer of B slots, each the shape of a hidden state, replaces the single recurrent state. K + 1
router pairs (write, read), one pair per step, each `Linear(d, B)` + softmax over slots per token,
read the *same* query: the state entering that step.

    M = [e, 0, …, 0]                            (B, T, slots, d); slot 0 = √d-scaled embedding
    pair 0 (transitional), query p = f_pre(e):  M += w ⊗ p;  h⁰ = Σ_b r_b m_b
    pair t+1, query h^t:  u = f_core(h^t);      M += w ⊗ u;  h^{t+1} = Σ_b r_b m_b
    (each read after its pair's write)
    the last read h^K is the "final read" into the coda

Writes are additive into every slot; reads are convex combinations; the core never sees a step
index, so iteration identity enters only through the step-specific routers. Router logits and
softmax are computed in fp32 even under autocast. Everything is per token, so decoding needs no
cache for the buffer.

How it is computed. Every slot is a per-token linear combination of the J values written so far
(v = [e, p, u⁰, …]): m_b = Σ_j c[b, j]·v_j, where c starts as the one-hot "e in slot 0" and each
write appends the column w. A read is then Σ_b r_b m_b = Σ_j (Σ_b r_b c[b, j])·v_j: a per-token
weighted sum of the J ≤ K + 2 values, with the small (B, T, slots, J) coefficients doing the
routing. This is exactly the buffer arithmetic above, but never materialises the (B, T, slots, d)
buffer: less memory and time, and autograd keeps only the values, which the layers keep anyway.
`buffer(ctx)` rebuilds the slots for probes.

Depth is elastic (docs/design.md, "MeSH at any depth"). The model has one router pair per step up to
`ModelConfig.loop_cap` (max_loops, default K): pairs 0 … cap. Run with K' loops, step t uses pair
min(t + 1, cap): fewer loops use the first K' + 1 pairs and the coda reads what pair K' read (the
same read that feeds step K' + 1 when more loops run, so a per-token early exit reads exactly the
state it would have carried on with); beyond the cap the last pair is reused. The slot count stays K
+ 3 for the spec's K.

`scheme_options.routing = "uniform"` is the frozen-router ablation: no router parameters, every
write and read weight is 1/B, so the scheme keeps MeSH's buffer arithmetic without learned,
step-specific routing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.model.layers import at_least_fp32
from meshlm.model.loop_lora import PerStep
from meshlm.model.schemes import LoopContext, Scheme, register


class Router(nn.Linear):
    """One router pair fused into a single Linear(d, 2B): columns [0, B) write, [B, 2B) read.

    Fusing is exactly two Linear(d, B) routers (same parameters: 2·B·(d+1)) computed in one matmul.
    `product`, where decoding set one, computes the fp32 logits in F.linear's place.
    """

    def __init__(self, d_model: int, slots: int):
        super().__init__(d_model, 2 * slots)
        self.slots = slots
        # decoding's product over this weight (meshlm.runtime.split_linear.split_linears with the
        # compiled kernel: each row's bits whatever else the batch holds), or None: F.linear
        self.product = None

    def forward(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, d) -> write and read weights, each (B, T, slots), softmax in at least fp32."""
        if (query.dtype in (torch.float16, torch.bfloat16)
            or torch.is_autocast_enabled(query.device.type)):
            # fp32 logits, even under autocast
            with torch.autocast(query.device.type, enabled=False):
                logits = F.linear(at_least_fp32(query), at_least_fp32(self.weight),
                                  at_least_fp32(self.bias))
        else:
            logits = super().forward(query) if self.product is None else self.product(query)
        return self.softmax(logits.unflatten(-1, (2, self.slots)))

    @staticmethod
    def softmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, 2, slots) logits -> write and read weights, both in one kernel. Under autograd
        the softmax runs slots-major, (2, slots, B·T), and hands back a view in the token-major
        shape: over a dimension of a few slots the token-major kernel takes a scalar pass per token
        (on the depth study's training step, 0.6 of its 0.62 ms forward and backward against 0.08
        slots-major, a router pair a step). Its lanes vectorize across tokens, so a token's bits
        may depend on where it sits in the batch: inference keeps the token-major kernel, which
        gives each token the same bits in any batch (served == alone)."""
        if logits.requires_grad:
            weights = logits.flatten(0, -3).permute(1, 2, 0).softmax(1).permute(2, 0, 1)
            weights = weights.unflatten(0, logits.shape[:-2])
        else:
            weights = logits.softmax(-1)
        return weights[..., 0, :], weights[..., 1, :]


class UniformRouter(nn.Module):
    """The frozen-uniform ablation: write and read weights 1/B for every token, no parameters."""

    def __init__(self, slots: int):
        super().__init__()
        self.slots = slots

    def forward(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*query.shape[:-1], self.slots)
        uniform = torch.full(shape, 1.0 / self.slots, dtype=at_least_fp32(query).dtype,
                             device=query.device)
        return uniform, uniform


@register("mesh")
class MeSH(Scheme):
    def __init__(self, cfg):
        super().__init__(cfg)
        # option "slots"; None: K + 3 (the paper's rule)
        self.slots = self.options["slots"] or cfg.layout.n_steps + 3
        if self.options["routing"] == "uniform":
            # one stateless router serves every step
            self.routers = PerStep([UniformRouter(self.slots)])
        else:  # one pair per step up to the cap (pair 0 is the transitional one): cap + 1 pairs
            self.routers = PerStep(Router(cfg.d_model, self.slots) for _ in range(cfg.loop_cap + 1))

    def facts(self) -> dict[str, int]:
        """Slots, and learned router pairs (cap + 1; 0 under uniform routing, whose router has no
        weights)."""
        return {"slots": self.slots,
                "router_pairs": sum(1 for m in self.modules() if isinstance(m, Router))}

    def _write_read(self, pair: int, query: torch.Tensor, value: torch.Tensor, ctx: LoopContext):
        """Route with `query`, add `value` into every slot, then read. Returns the read state (B, T,
        d)."""
        write, read = self.routers.at(pair)(query)  # (B, T, slots) each
        ctx.routing.append((write, read))
        ctx.values.append(value)
        # (B, T, slots, J)
        ctx.coefficients = torch.cat([ctx.coefficients, write.unsqueeze(-1)], dim=-1)
        return self._read(read, ctx)

    @staticmethod
    def _read(read: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        """Σ_b read_b·m_b for read weights (B, T, slots): a per-token mix of the written values, (B,
        T, d)."""
        dtype = ctx.values[-1].dtype
        # inference: two matmuls, the mix (B, T, 1, J), then over the stacked values (B, T, J, d)
        if not torch.is_grad_enabled():
            mix = (read.unsqueeze(-2) @ ctx.coefficients).to(dtype)
            return (mix @ torch.stack(ctx.values, dim=-2)).squeeze(-2)
        # autograd: the mix as a product and a sum over the slots (a batched (1, slots) @ (slots, J)
        # product per token is slower forward and backward at these sizes), then Σ_j mix_j·v_j with
        # references to the values, not stacked copies
        mix = (read.unsqueeze(-1) * ctx.coefficients).sum(-2).to(dtype)  # (B, T, J)
        h = mix[..., 0:1] * ctx.values[0]
        for j in range(1, len(ctx.values)):
            h = torch.addcmul(h, mix[..., j:j + 1], ctx.values[j])
        return h

    def begin(self, ctx, p):
        b, t, _ = ctx.e.shape
        # slot 0 holds the √d-scaled embedding e, the other slots start empty: c = one-hot (slot 0,
        # value 0)
        ctx.values = [ctx.e]
        ctx.coefficients = F.one_hot(torch.zeros(b, t, dtype=torch.long, device=ctx.e.device),
                                     self.slots)
        ctx.coefficients = ctx.coefficients.to(torch.promote_types(ctx.e.dtype,
                                                                   torch.float32)).unsqueeze(-1)
        ctx.h0 = self._write_read(0, p, p, ctx)  # transitional write/read between prelude and loop
        return ctx.h0

    def update(self, t, h, u, ctx):
        return self._write_read(t + 1, h, u, ctx)

    def early_exit(self, h, ctx, n_steps):
        """A draft stopping before step n_steps reads the buffer with the read router of the final
        pair, the one the coda was trained behind, queried by the current state (the step's own read
        router prepares the next core pass, not the coda). Draft-only: the loop's state and buffer
        are unchanged."""
        _, read = self.routers.at(n_steps)(h)
        return self._read(read, ctx)

    def truncate(self, ctx: LoopContext) -> None:
        """Truncated backprop starts: fold the values written so far by loop steps (constants: they
        ran without autograd) into one per slot, r_b = Σ_{j ≥ 2} c[b, j]·v_j, with identity
        coefficients. Exact, and memory then holds e, p, B slot remainders and the k values still to
        come, not one value per step run."""
        entry = 2  # e and p: written before the loop, they keep their gradients
        if len(ctx.values) <= entry + self.slots:
            return
        with torch.no_grad():
            rest = torch.stack(ctx.values[entry:], dim=0)  # (J − 2, B, T, d)
            coefficients = ctx.coefficients[..., entry:].to(rest.dtype)  # (B, T, slots, J − 2)
            remainders = torch.einsum("btsj,jbtd->sbtd", coefficients, rest).unbind(0)
        eye = torch.eye(self.slots, dtype=ctx.coefficients.dtype, device=ctx.coefficients.device)
        ctx.values = ctx.values[:entry] + list(remainders)
        ctx.coefficients = torch.cat([ctx.coefficients[..., :entry].detach(),
                                      eye.expand(*ctx.coefficients.shape[:-2], -1, -1)], dim=-1)

    @staticmethod
    def buffer(ctx: LoopContext) -> torch.Tensor:
        """The paper's slots m_b, rebuilt from the coefficients: (B, T, slots, d)."""
        values = torch.stack(ctx.values, dim=0)  # (J, B, T, d)
        return torch.einsum("btsj,jbtd->btsd", ctx.coefficients.to(values.dtype), values)

    def flops_per_token(self, d_model, n_steps):
        # Counted as the paper does (≈0.7551 GFLOPs for 1.4B, 4096 tokens): per router pair two
        # Linear(d, B) (2d+1 FLOPs per output) plus one FLOP per buffer element written and read.
        # A forward of n_steps uses n_steps + 1 pairs whatever the cap; uniform routing has no
        # router matmuls.
        router = 0 if self.options["routing"] == "uniform" else 2 * (2 * d_model + 1)
        return (n_steps + 1) * self.slots * (router + 2 * d_model)
