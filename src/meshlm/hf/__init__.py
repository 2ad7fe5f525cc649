"""Hugging Face integration: meshlm models as transformers `AutoModelForCausalLM`s.

    from meshlm.hf import save_hf
    save_hf(model, "out/mesh-hf", tokenizer="default")            # weights, config, tokenizer,
                                                                    remote code
    AutoModelForCausalLM.from_pretrained("out/mesh-hf")           # after `import meshlm.hf`
                                                                    (registered)
    AutoModelForCausalLM.from_pretrained("out/mesh-hf", trust_remote_code=True)
        # meshlm not needed
    lm_eval --model hf --model_args pretrained=out/mesh-hf,trust_remote_code=True ...

Importing this package registers `MeshConfig` / `MeshForCausalLM` with `AutoConfig` and
`AutoModelForCausalLM`. The saved folder holds model.safetensors, config.json (with `auto_map`),
generation_config.json, the tokenizer (tokenizer.json + tokenizer_config.json, a
`PreTrainedTokenizerFast` that pads on the left, as batched generation needs), the generated
configuration_meshlm.py / modeling_meshlm.py (see meshlm.hf.remote) and a model card, README.md
(meshlm.hf.card).
"""
from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from meshlm import atomic
from meshlm.config import ModelConfig
from meshlm.data.tokenizer import TEMPLATE_FILE, TextTokenizer, load_tokenizer
from meshlm.errors import CheckpointError
from meshlm.hf.card import model_card
from meshlm.hf.configuration import MeshConfig
from meshlm.hf.modeling import MeshForCausalLM
from meshlm.model import MeshLM
from meshlm.quant.calibrate import structure_of

AutoConfig.register(MeshConfig.model_type, MeshConfig, exist_ok=True)
AutoModelForCausalLM.register(MeshConfig, MeshForCausalLM, exist_ok=True)

__all__ = ["MeshConfig", "MeshForCausalLM", "config_from_model_config", "from_meshlm",
           "hf_tokenizer",
           "load_hf", "save_hf"]


def config_from_model_config(cfg: ModelConfig, eos_id: int = 0, pad_id: int = 1,
                            quantization: dict | None = None) -> MeshConfig:
    """`quantization`: the int8/int4 layers of a quantized model (meshlm.quant.structure_of)."""
    return MeshConfig(
        meshlm=cfg.to_dict(),
        meshlm_quantization=quantization,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_attention_heads=cfg.n_heads,
        num_hidden_layers=cfg.layout.unrolled_depth,
        max_position_embeddings=cfg.context_length,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=eos_id,  # Pythia convention: <|endoftext|> also starts a document
    )


def from_meshlm(model: MeshLM, eos_id: int = 0, pad_id: int = 1) -> MeshForCausalLM:
    """Wrap a MeshLM's weights (copied) in a MeshForCausalLM; int8/int4 layers (`meshlm quantize`)
    stay as they are."""
    quantization = structure_of(model)
    hf = MeshForCausalLM(config_from_model_config(model.config, eos_id, pad_id, quantization))
    hf.model.load_state_dict(model.state_dict())
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = eos_id, pad_id
    if quantization:  # .to(dtype) would turn the bf16 scales into the table's dtype
        return hf.eval()
    return hf.to(next(model.parameters()).dtype).eval()


def hf_tokenizer(tokenizer: TextTokenizer) -> PreTrainedTokenizerFast:
    """The meshlm tokenizer as a transformers fast tokenizer (EOS and padding tokens set, padding on
    the left: a decoder-only model continues each row from its last token, so padding must come
    before the prompt)."""
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf,
                                   eos_token=tokenizer.hf.id_to_token(tokenizer.eos_id),
                                   bos_token=tokenizer.hf.id_to_token(tokenizer.eos_id),
                                   pad_token=tokenizer.hf.id_to_token(tokenizer.pad_id),
                                   model_max_length=None, padding_side="left")


def save_hf(model: MeshLM | MeshForCausalLM, folder: str | Path,
            tokenizer: str | TextTokenizer | None = "default", meta: dict | None = None,
            chat_template: str | None = None) -> Path:
    """Save a model (and its tokenizer) as a Hugging Face folder that also loads without meshlm;
    `meta` is the source checkpoint's config.json, whose training record goes into the model
    card; `chat_template` (a fine-tuned run's) goes into chat_template.jinja, where
    transformers' `apply_chat_template` finds it."""

    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer
    if isinstance(model, MeshLM):
        model = from_meshlm(model, *((tok.eos_id, tok.pad_id) if tok else (0, 1)))
    folder = Path(folder)
    # complete or absent: a failure leaves no half folder
    with atomic.new_folder(folder, "exporting to") as tmp:
        model.save_pretrained(tmp)
        if tok is not None:
            fast = hf_tokenizer(tok)
            fast.model_max_length = model.config.max_position_embeddings
            fast.save_pretrained(tmp)
        if chat_template:
            (tmp / TEMPLATE_FILE).write_text(chat_template, encoding="utf-8")
        cfg = model.model.config  # the wrapped MeshLM's ModelConfig
        (tmp / "README.md").write_text(model_card(cfg, meta, str(folder)), encoding="utf-8")
    return folder


def load_hf(folder: str | Path) -> MeshForCausalLM:
    """Load a folder written by save_hf; a clear CheckpointError if the weights are missing or
    damaged."""
    folder = Path(folder)
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{weights} is missing; re-export the model with `meshlm convert`")
    try:
        return MeshForCausalLM.from_pretrained(folder).eval()
    except Exception as err:  # safetensors and transformers raise assorted types for damaged files
        raise CheckpointError(f"{folder} cannot be loaded as a meshlm Hugging Face model "
                              f"({str(err).splitlines()[0][:160]}); re-export it with `meshlm "
                              "convert`") from None
