"""`MeshConfig`: the Hugging Face config of a meshlm model (model_type "meshlm").

Self-contained on purpose: `save_pretrained` copies this file verbatim next to the weights as
`configuration_meshlm.py`, so the folder loads with `trust_remote_code=True` where meshlm is not
installed. The whole meshlm `ModelConfig` travels as one plain dict (`meshlm`); the standard Hugging
Face fields are derived from it by `meshlm.hf.config_from_model_config`. `num_hidden_layers` is the
*unrolled* depth (prelude + every pass of every core layer + coda): transformers sizes its KV caches
from it, and a looped model needs one cache entry per unrolled layer. `loops` and `exit` are
inference settings (depth and per-token adaptive exit); forward also takes them per call. The
classic `__init__(**kwargs)` form works with every transformers 4.x/5.x config base class.
"""
from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig


class MeshConfig(PretrainedConfig):
    model_type = "meshlm"

    def __init__(
        self,
        meshlm: dict[str, Any] | None = None,  # meshlm.config.ModelConfig.to_dict()
        vocab_size: int = 8192,
        hidden_size: int = 256,
        num_attention_heads: int = 8,
        num_hidden_layers: int = 1,  # unrolled depth: one KV cache entry per unrolled layer
        max_position_embeddings: int = 512,
        # loop steps at inference (None: the trained K); single-core specs
        loops: int | None = None,
        # per-token adaptive exit at inference, e.g. "state:0.05" (None: off)
        exit: str | None = None,
        # `meshlm quantize` output: {"bits", "group_size", "layers"}, the int8/int4 layers the
        # weights file holds (not `quantization_config`, which names a transformers quantizer)
        meshlm_quantization: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        self.loops = loops
        self.exit = exit
        self.meshlm_quantization = meshlm_quantization
        self.meshlm = dict(meshlm or {})
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.num_hidden_layers = num_hidden_layers
        self.max_position_embeddings = max_position_embeddings
        # embed_in and embed_out are separate, as in Pythia
        kwargs.setdefault("tie_word_embeddings", False)
        kwargs.setdefault("use_cache", True)
        super().__init__(**kwargs)
