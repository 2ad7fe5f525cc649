"""Hidden-state probes of the paper (§2; docs/evaluation.md) plus router behaviour, per sample, then
mean ± std.

For every held-out sample (one window of T tokens) the model runs once with `return_states=True`,
giving the stage matrices (T × d each; tokens are the examples):

    stages  e, h⁰, h¹ … h^K, coda      (e = scaled embedding, h^t = loop states, coda = f_coda(h^K))

and, per sample:
- relative update of each block f with input h: 2‖f(h) − h‖_F / (‖f(h)‖_F + ‖h‖_F) (0 = identity, 2
  = the output is −h); blocks are the prelude (e → p), every loop step seen two ways — "core" h^t →
  f_core(h^t) and "state" h^t → h^{t+1} (they coincide for `base`; for MeSH the state is the buffer
  read) — and the coda (h^K → coda);
- CKA between all stage pairs with an RBF kernel, bandwidth σ = median pairwise (Euclidean) distance
  between the tokens of that stage, and with a linear kernel;
- the top-50 singular values normalised by the largest, σ_i/σ_0 (of the uncentred matrix), and the
  entropy effective rank exp(H(p)), p = σ / Σσ (Roy & Vetterli 2007);
- MeSH routing, per router pair (0 = transitional, t + 1 = loop step t): mean write and read weight
  per slot (slot usage; which slots each step reads) and the mean per-token entropy of both
  distributions.

Everything is computed in float64. `probe` returns plain lists (JSON-ready): mean, std and
per-sample values of every quantity; `meshlm probe` writes them as a ProbeResult
(meshlm.evaluation.results: the schema of probe.json).
"""
from __future__ import annotations

import math
from typing import Any

import torch

TOP_SINGULAR = 50


# -- the measures ----------------------------------------------------------------------------------
def relative_update(h: torch.Tensor, fh: torch.Tensor) -> float:
    """2‖f(h) − h‖_F / (‖f(h)‖_F + ‖h‖_F) for one sample's matrices (T, d)."""
    h, fh = h.double(), fh.double()
    denominator = fh.norm() + h.norm()
    return (2 * (fh - h).norm() / denominator).item() if denominator > 0 else 0.0


def linear_gram(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x @ x.T  # (T, T)


def median(values: torch.Tensor) -> torch.Tensor:
    """The usual median (mean of the two middle values for an even count; torch.median takes the
    lower)."""
    v = values.flatten().sort().values
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def rbf_gram(x: torch.Tensor) -> torch.Tensor:
    """exp(−‖x_i − x_j‖² / (2σ²)), σ = median distance over pairs i < j (all-equal rows: σ := 1)."""
    x = x.double()
    sq = torch.cdist(x, x).square()  # (T, T)
    upper = torch.triu_indices(len(x), len(x), offset=1)
    sigma = median(sq[upper[0], upper[1]].sqrt())
    sigma = sigma if sigma > 0 else torch.ones((), dtype=x.dtype)
    return torch.exp(-sq / (2 * sigma**2))


def center(gram: torch.Tensor) -> torch.Tensor:
    """H K H with H = I − 11ᵀ/n."""
    return gram - gram.mean(0, keepdim=True) - gram.mean(1, keepdim=True) + gram.mean()


def cka_from_grams(kx: torch.Tensor, ky: torch.Tensor) -> float:
    """HSIC(K, L) / √(HSIC(K, K) · HSIC(L, L)), biased HSIC = tr(K_c L_c) (the 1/(n−1)² cancels)."""
    kx, ky = center(kx), center(ky)
    hsic_xy, hsic_xx, hsic_yy = (kx * ky).sum(), (kx * kx).sum(), (ky * ky).sum()
    denominator = (hsic_xx * hsic_yy).sqrt()
    return (hsic_xy / denominator).item() if denominator > 0 else 0.0


KERNELS = {"rbf": rbf_gram, "linear": linear_gram}


def cka(x: torch.Tensor, y: torch.Tensor, kernel: str = "rbf") -> float:
    """CKA between two representations of the same T examples: x (T, d1), y (T, d2)."""
    gram = KERNELS[kernel]
    return cka_from_grams(gram(x), gram(y))


def cka_matrix(stages: list[torch.Tensor], kernel: str) -> list[list[float]]:
    """CKA between every pair of stage matrices (S × S, symmetric, 1 on the diagonal)."""
    grams = [KERNELS[kernel](s) for s in stages]
    n = len(grams)
    out = [[1.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            out[i][j] = out[j][i] = cka_from_grams(grams[i], grams[j])
    return out


def singular_values(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(x.double())  # descending, min(T, d) values


def normalised_spectrum(x: torch.Tensor, k: int = TOP_SINGULAR) -> list[float]:
    """σ_i / σ_0 for the first min(k, T, d) singular values."""
    s = singular_values(x)[:k]
    return (s / s[0] if s[0] > 0 else s).tolist()


def effective_rank(x: torch.Tensor) -> float:
    """exp of the Shannon entropy of the normalised singular values: r for r equal non-zero
    values."""
    s = singular_values(x)
    if s.sum() <= 0:
        return 0.0
    p = s / s.sum()
    p = p[p > 0]
    return math.exp(-(p * p.log()).sum().item())


def entropy(weights: torch.Tensor) -> torch.Tensor:
    """Per-row Shannon entropy (nats) of distributions along the last dim."""
    w = weights.double()
    return -(w * w.clamp_min(1e-30).log()).sum(-1)


# -- one forward, many samples ---------------------------------------------------------------------
def stage_names(n_states: int) -> list[str]:
    return ["e", *(f"h{t}" for t in range(n_states)), "coda"]


def blocks(model, stages) -> tuple[list[str], list[tuple], list[tuple]]:
    """Block labels and (input, output) pairs, batched (B, T, d): the "core" and the "state"
    view."""
    layout = model.config.layout
    core, state, labels = [], [], []
    if layout.prelude:
        labels.append("prelude")
        core.append((stages.embeddings, stages.prelude))
        state.append((stages.embeddings, stages.prelude))
    for t, u in enumerate(stages.core_outputs):
        labels.append(f"loop {t + 1}")
        core.append((stages.states[t], u))
        state.append((stages.states[t], stages.states[t + 1]))
    if layout.coda:
        labels.append("coda")
        core.append((stages.states[-1], stages.coda))
        state.append((stages.states[-1], stages.coda))
    return labels, core, state


def sample_measures(model, stages, b: int) -> dict[str, Any]:
    """Every measure for sample b of a batched forward."""
    matrices = [stages.embeddings[b], *(h[b] for h in stages.states), stages.coda[b]]
    _, core, state = blocks(model, stages)
    out = {
        "update_core": [relative_update(h[b], f[b]) for h, f in core],
        "update_state": [relative_update(h[b], f[b]) for h, f in state],
        "cka_rbf": cka_matrix(matrices, "rbf"),
        "cka_linear": cka_matrix(matrices, "linear"),
        "spectrum": [normalised_spectrum(m) for m in matrices],
        "effective_rank": [effective_rank(m) for m in matrices],
    }
    if stages.routing:
        write = torch.stack([w[b] for w, _ in stages.routing])  # (pairs, T, slots)
        read = torch.stack([r[b] for _, r in stages.routing])
        out.update(write_usage=write.double().mean(1).tolist(),
                   read_usage=read.double().mean(1).tolist(),
                   write_entropy=entropy(write).mean(1).tolist(),
                   read_entropy=entropy(read).mean(1).tolist())
    return out


def _spread(values: list) -> dict[str, Any]:
    """Mean and sample standard deviation over samples, elementwise (a Spread in probe.json)."""
    x = torch.tensor(values, dtype=torch.float64)  # (N, ...)
    std = x.std(0) if len(values) > 1 else torch.zeros_like(x[0])  # sample std (N − 1)
    return {"mean": x.mean(0).tolist(), "std": std.tolist()}


@torch.no_grad()
def probe(model, samples: torch.Tensor, batch_size: int = 8,
          states_out: list | None = None) -> dict[str, Any]:
    """All probes over `samples` (N, T) token ids; mean ± std over samples (and every per-sample
    value).

    If `states_out` is a list, each sample's stage matrices are appended to it as one (S, T, d)
    tensor.
    """
    device = next(model.parameters()).device
    per_sample: list[dict] = []
    labels = names = None
    for start in range(0, len(samples), batch_size):
        stages = model(samples[start:start + batch_size].to(device), return_states=True).stages
        labels, names = blocks(model, stages)[0], stage_names(len(stages.states))
        for b in range(len(stages.embeddings)):
            per_sample.append(sample_measures(model, stages, b))
            if states_out is not None:
                states_out.append(torch.stack([stages.embeddings[b], *(h[b] for h in stages.states),
                                               stages.coda[b]]).float().cpu())
    keys = per_sample[0].keys()
    result = {"samples": len(samples), "tokens": samples.shape[1], "stages": names,
              "blocks": labels,
              **{k: _spread([s[k] for s in per_sample]) for k in keys},
              "per_sample": {k: [s[k] for s in per_sample] for k in keys}}
    if "write_usage" in keys:
        result["slots"] = len(per_sample[0]["write_usage"][0])
        result["max_entropy"] = math.log(result["slots"])
    return result
