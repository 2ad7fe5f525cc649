"""The model card (README.md) of an exported Hugging Face folder: what the model is and how to load
it.

A card states the architecture (spec, scheme, backbone, sizes from meshlm's accounting), the
training data and tokens when the export came from a meshlm training run (the checkpoint's
config.json: `train.data`, `tokens`, `step`, `val_loss`), and the exact loading code, with and
without meshlm installed. Fields a run does not record are said to be unknown rather than guessed.
"""
from __future__ import annotations

from typing import Any

from meshlm.config import ModelConfig
from meshlm.model.accounting import describe

_LOADING = """```python
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

folder = "{folder}"  # this folder
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
# meshlm need not be installed
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
# pads on the left
inputs = tokenizer(["To be, or not to be", "Hello"], return_tensors="pt", padding=True)
out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
print(tokenizer.batch_decode(out, skip_special_tokens=True))

generator = pipeline("text-generation", model=folder, trust_remote_code=True)
```

With meshlm installed, `import meshlm.hf` registers the model type, and both loaders work without
`trust_remote_code`. `trust_remote_code=True` runs `modeling_meshlm.py` from this folder: meshlm's
own model code, generated when the folder was written. transformers 5 reads config.json before the
tokenizer, so the tokenizer needs the flag as well (else it asks whether to run the custom code).

lm-evaluation-harness:

```bash
lm_eval --model hf --model_args pretrained={folder},trust_remote_code=True --tasks TASKS
```
"""


def _training(meta: dict[str, Any] | None, cfg: ModelConfig) -> list[str]:
    """Lines on the training data and length, from a meshlm checkpoint's config.json (or 'unknown').
    train.seq_len 0 means the model's context length, which is what the card says."""
    if not meta or "train" not in meta:
        return ["- training: not recorded (this folder was not exported from a meshlm training "
                "run)"]
    train = meta["train"]
    data = train.get("data") or "meshlm's embedded public-domain English corpus"
    seq_len = train.get("seq_len") or cfg.context_length
    lines = [f"- training data: {data} (tokenizer `{train.get('tokenizer', 'default')}`, "
             f"sequence length {seq_len})"]
    if meta.get("tokens") is not None:
        lines.append(f"- training tokens: {int(meta['tokens']):,} ({meta.get('step', '?')} steps)")
    if meta.get("val_loss") is not None:
        lines.append(f"- validation loss at export: {meta['val_loss']:.4f}")
    if meta.get("retrofit"):
        lines.append(f"- retrofitted from: {meta['retrofit'].get('source', 'a pretrained stack')}")
    return lines


def model_card(cfg: ModelConfig, meta: dict[str, Any] | None = None,
               folder: str = "path/to/this/folder") -> str:
    """README.md text for an exported folder of the model `cfg`; `meta` is the source checkpoint's
    config.json."""
    acc = describe(cfg)
    loop = (f"{acc.unique_layers} unique layers run as {acc.unrolled_layers} unrolled layers "
            f"({acc.loop_steps} loop steps)")
    lines = [
        "---", "library_name: transformers", "pipeline_tag: text-generation",
        "tags: [meshlm, looped-transformer]",
        "---", "", f"# meshlm `{cfg.spec}` {cfg.scheme}", "",
        "A recursive (looped) Transformer language model made with meshlm. `mesh` is MeSH, "
        "Memory-as-State-Highways (Yu et al., arXiv 2510.07739): a buffer of slots with per-step "
        "write and read routers carries the state between loop iterations.", "",
        "## Model", "",
        f"- spec: `{cfg.spec}` (prelude + recurrent core × loops + coda); {loop}",
        f"- state scheme: `{cfg.scheme}`" + (f" ({acc.slots} slots)" if acc.slots else ""),
        f"- backbone: {cfg.backbone}; d_model {cfg.d_model}, {cfg.n_heads} heads, vocabulary "
        f"{cfg.vocab_size:,}, context {cfg.context_length}",
        f"- parameters: {acc.total_params:,} ({acc.non_embedding_params:,} non-embedding)",
        f"- forward FLOPs per token: {acc.forward_flops_per_token:,}", "",
        "## Training", "", *_training(meta, cfg), "",
        "## Loading", "", _LOADING.format(folder=folder),
    ]
    return "\n".join(lines)
