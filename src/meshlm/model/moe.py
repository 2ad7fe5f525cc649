"""OLMoE-style Mixture-of-Experts layers: the Llama layer with QK-norm and a top-k routed set of
SwiGLU experts.

    x ── RMSNorm ── Attn (q/k RMSNorm over the full projections) ── + ── RMSNorm ── MoE ── + ──→

    MoE(x):  p = softmax(gate x)  (fp32, over E experts)        gate: Linear(d, E), no bias
             (w, i) = top-k of p   (w renormalised to sum 1 if norm_topk_prob)
             y = Σ_j w_j · expert_{i_j}(x),   expert_e(x) = down_e(silu(gate_e x) · up_e x)

Equal to transformers' `OlmoeForCausalLM` with copied weights, logits and load-balancing loss
(tests/test_moe.py). Expert weights are stored as OLMoE's fused tensors: `experts.gate_up_proj` (E,
2·I, d), rows [gate | up], and `experts.down_proj` (E, d, I).

Dispatch computes only the selected experts: the N·k (token, expert) assignments are sorted by
expert, each expert runs one matmul pair over its contiguous group, and the weighted outputs are
`index_add`ed back to their tokens. There is no dense all-experts path. Group sizes are read on the
host (one sync per layer). The routing weight scales each expert's (n_e, I) hidden rather than its
(n_e, d) output (the same thing, since down_proj is linear; cheaper when I < d, as in OLMoE). On
CPU, E small matmuls run below the speed of one large one: with fine-grained experts (E = 64 of
width d/4) a training step costs ≈1.5× that of a dense model of equal active size
(docs/backbones.md). `F.grouped_mm` (one kernel, no host sync) is the natural GPU replacement for
the loop.

Auxiliary losses (`router_losses`), from the router logits of every router call in a forward — each
layer, and each *pass* of a looped core layer, contributes its own logits:
- load balancing (Switch Transformer, as transformers' `load_balancing_loss_func`): E · Σ_e f_e ·
  P_e, with f_e the share of top-k assignments and P_e the mean router probability of expert e, both
  pooled over all router calls and (non-padding) tokens. Its minimum, at perfectly uniform routing,
  is k.
- router z-loss (ST-MoE, OLMoE): the mean over router calls and tokens of logsumexp(logits)².
`MeshLM` adds them to the training loss with `aux_loss_weight` and `z_loss_weight`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshlm.backbones import layer_of
from meshlm.config import ModelConfig
from meshlm.model.layers import at_least_fp32
from meshlm.model.llama import LlamaLayer


class ExpertRouter(nn.Linear):
    """Linear(d, E) without bias; returns logits (N, E), top-k weights (N, k) and expert ids (N,
    k). `product`, where decoding set one, computes the fp32 logits in F.linear's place."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg.d_model, cfg.n_experts, bias=False)
        self.top_k, self.normalise = cfg.top_k, cfg.norm_topk_prob
        # decoding's product over this weight (meshlm.runtime.split_linear.split_linears with the
        # compiled kernel: each row's bits whatever else the batch holds), or None: F.linear
        self.product = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if x.dtype in (torch.float16, torch.bfloat16) or torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):  # fp32 logits, even under autocast
                logits = F.linear(at_least_fp32(x), at_least_fp32(self.weight))
        else:  # (N, E)
            logits = super().forward(x) if self.product is None else self.product(x)
        weights, experts = logits.softmax(-1).topk(self.top_k, dim=-1)  # (N, k) each
        if self.normalise:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights, experts


class Experts(nn.Module):
    """E SwiGLU experts as two stacked tensors; `forward` runs each token through its k chosen
    experts only."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, d, width = cfg.n_experts, cfg.d_model, cfg.mlp_width
        # rows [gate | up] per expert
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * width, d))
        # output projection (depth-scaled init)
        self.down_proj = nn.Parameter(torch.empty(e, d, width))

    def forward(self, x: torch.Tensor, weights: torch.Tensor,
                experts: torch.Tensor) -> torch.Tensor:
        """x (N, d), weights and experts (N, k) -> (N, d) = Σ_j weights[:, j] · expert_{experts[:,
        j]}(x)."""
        k = experts.shape[-1]
        # the N·k (token, choice) assignments grouped by expert
        order = experts.flatten().argsort(stable=True)
        tokens = order // k  # (N·k,) the token of each grouped assignment
        # host sync
        sizes = torch.bincount(experts.flatten(), minlength=self.gate_up_proj.shape[0]).tolist()
        grouped_x, grouped_w = x[tokens], weights.flatten()[order, None]  # (N·k, d), (N·k, 1)
        outputs = []
        for chunk, w, gate_up, down, size in zip(grouped_x.split(sizes), grouped_w.split(sizes),
                                                 self.gate_up_proj.unbind(0),
                                                 self.down_proj.unbind(0), sizes):
            if size:  # unselected experts do no work (and get a zero gradient)
                gate, up = F.linear(chunk, gate_up).chunk(2, dim=-1)  # (n_e, I) each
                # the routing weight scales the (n_e, I) hidden: down is linear, and I ≤ d is the
                # cheaper side
                outputs.append(F.linear(F.silu(gate) * up * w.to(up.dtype), down))  # (n_e, d)
        y = torch.cat(outputs).to(x.dtype)  # (N·k, d), grouped by expert
        # each token: the sum of its k weighted outputs
        return x.new_zeros(x.shape).index_add(0, tokens, y)


class SparseMoE(nn.Module):
    """The feed-forward block of an OLMoE layer; appends its router logits (N, E) to
    `router_logits`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = ExpertRouter(cfg)
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor,
                router_logits: list[torch.Tensor] | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N = B·T, d)
        logits, weights, experts = self.gate(flat)
        if router_logits is not None:
            router_logits.append(logits)
        return self.experts(flat, weights, experts).view_as(x)


@layer_of("olmoe")
class OlmoeLayer(LlamaLayer):
    """Llama layer (QK-norm on by default for this backbone) whose MLP is a sparse mixture of
    experts."""

    FeedForward = SparseMoE


def router_losses(router_logits: list[torch.Tensor], n_experts: int, top_k: int,
                  token_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(load-balancing loss, router z-loss) over every router call's logits, each (N, E); see the
    docstring.

    token_mask (N,): 1 for tokens that count, 0 for padding (None: all count).
    """
    # (L, N, E), L = router calls in this forward
    logits = at_least_fp32(torch.stack(router_logits))
    calls, n = logits.shape[:2]
    # (N,)
    weight = logits.new_ones(n) if token_mask is None else token_mask.reshape(-1).to(logits.dtype)
    rows = calls * weight.sum()
    probs = logits.softmax(-1)
    chosen = probs.topk(top_k, dim=-1).indices  # (L, N, k)
    # f_e: top-k assignment share (a count: no gradient, as in Switch Transformer)
    with torch.no_grad():
        assigned = weight.new_zeros(n_experts).index_add_(
            0, chosen.flatten(), weight[None, :, None].expand(calls, n, top_k).flatten())
    prob_share = (probs * weight[:, None]).sum((0, 1))  # (E,)
    balance = n_experts * (assigned / rows * prob_share / rows).sum()
    z_loss = (logits.logsumexp(-1).pow(2) * weight).sum() / rows
    return balance, z_loss
