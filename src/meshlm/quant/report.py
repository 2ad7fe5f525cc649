"""How quantization error compounds over loops: the figure a looped model's quantization is judged
by.

    states  after each loop step t (h⁰ = the prelude's output through scheme.begin, then h¹ … h^K),
            the relative distance ‖h_q^t − h^t‖ / ‖h^t‖ between the quantized and the full-precision
            model on the same windows (Frobenius over all tokens), and the same for the coda's
            output
    loss    the held-out loss of both at each loop count (1 … 2K for a weight-shared single-core
            model, else the trained schedule only), and the difference in nats: int8's target is
            +0.01 at K and +0.02 at 2K

Both models run in fp32 outside autocast (the quantized layers compute in bf16 inside their
kernels).
"""
from __future__ import annotations

import torch

from meshlm.evaluation.perplexity import default_loop_counts, mean_loss


@torch.no_grad()
def state_distances(full, quantized, batches: list[torch.Tensor]) -> dict[str, list[float]]:
    """{"states": [d_0 … d_K], "coda": [d]}: relative distances summed over `batches` of (B, T)
    ids."""
    num, den = None, None
    for ids in batches:
        a, b = (m(ids, return_states=True).stages for m in (full, quantized))
        pairs = [*zip(a.states, b.states), (a.coda, b.coda)]
        n = torch.tensor([float((y - x).double().pow(2).sum()) for x, y in pairs])
        d = torch.tensor([float(x.double().pow(2).sum()) for x, _ in pairs])
        num, den = (n, d) if num is None else (num + n, den + d)
    ratio = (num / den.clamp(min=1e-30)).sqrt().tolist()
    return {"states": ratio[:-1], "coda": ratio[-1:]}


def loss_by_loops(full, quantized, data, seq_len: int, sequences: int,
                  batch_size: int = 8) -> list[dict]:
    """[{"loops", "trained", "loss_full", "loss_quantized", "delta"}] at each loop count (module
    docstring)."""
    counts = default_loop_counts(full) or [None]
    trained = full.config.layout.n_steps
    rows = []
    for k in counts:
        kw = dict(batch_size=batch_size, max_sequences=sequences, loops=k)
        f, q = mean_loss(full, data, seq_len, **kw)["loss"], mean_loss(quantized, data, seq_len,
                                                                       **kw)["loss"]
        rows.append({"loops": k or trained, "trained": (k or trained) == trained, "loss_full": f,
                     "loss_quantized": q, "delta": q - f})
    return rows


def format_report(report: dict) -> str:
    """The report as the lines `meshlm quantize` prints."""
    lines = ["state distance ‖h_q − h‖/‖h‖ after each loop step: "
             + " ".join(f"{d:.4f}" for d in report["states"]) + f" | coda {report['coda'][0]:.4f}",
             "loops  loss full  loss quantized  delta (nats)"]
    for row in report["loss"]:
        mark = " (trained)" if row["trained"] else ""
        lines.append(f"{row['loops']:>5}  {row['loss_full']:9.4f}  {row['loss_quantized']:14.4f}  "
                     f"{row['delta']:+.4f}{mark}")
    return "\n".join(lines)
