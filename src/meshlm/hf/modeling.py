"""`MeshForCausalLM`: a meshlm model as a transformers `PreTrainedModel` + `GenerationMixin`.

It wraps the one `MeshLM` (as `self.model`, so weights are saved as "model.<meshlm name>") and
translates Hugging Face conventions to meshlm's:

    attention_mask (B, T_past + T)  -> padding_mask (left padding in batched generate() included)
    labels (B, T), shifted inside   -> targets = labels[:, 1:]
    cache (a transformers Cache)    -> the looped KV cache, one entry per *unrolled* layer

What is non-standard, and why:
- The cache is used only through `update(key, value, layer_idx)` and `get_seq_length()`, the stable
  public `Cache` API; slot numbers are unrolled layers (config.num_hidden_layers = unrolled depth,
  so the `DynamicCache` that `generate()` builds has the right size). Nothing else of transformers'
  internals is used.
- Depth and exit (`loops`, `exit`) may need more cache slots than `num_hidden_layers` (the trained
  unrolled depth): on the first call such a forward swaps generate()'s empty cache for a
  `DynamicCache()` that grows on use, and returns it, so generate() carries that one on.
- transformers 5.x renamed the cache argument and output field `past_key_values` -> `cache`; forward
  accepts both names and fills whichever field the installed `CausalLMOutputWithPast` declares.
- Gradient checkpointing (`gradient_checkpointing_enable()`, also under PEFT) checkpoints every
  layer with meshlm.model.recompute, as training does.
- A `meshlm quantize` checkpoint exports with its int8/int4 layers (meshlm.quant.linear, bundled):
  config.meshlm_quantization names them and they are rebuilt before the weights load.
- Weight init happens once, in `MeshLM.__init__` (meshlm.model.init); `_init_weights` only
  recomputes the rotary table that loading on the meta device leaves empty.

This file is also the source of the self-contained `modeling_meshlm.py` that `save_pretrained`
writes (meshlm.hf.remote concatenates it after the model sources), so it imports only torch,
transformers and meshlm.
"""
from __future__ import annotations

import torch
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from meshlm.backbones import BACKBONES
from meshlm.config import ModelConfig
from meshlm.generate.sampling import Sampling
from meshlm.generate.speculative import Speculation, SpeculationStats
from meshlm.generate.speculative import stream as speculative_stream
from meshlm.hf.configuration import MeshConfig
from meshlm.hf.remote import write_remote_code
from meshlm.model.exit import ExitRule
from meshlm.model.layers import RotaryEmbedding
from meshlm.model.lm import MeshLM
from meshlm.model.recompute import checkpoint_layers
from meshlm.quant.calibrate import empty_structure

# generate() arguments the speculative path understands; any other one is refused with its name
SPECULATIVE_KWARGS = {"input_ids", "attention_mask", "max_new_tokens", "do_sample", "temperature",
                      "top_k", "top_p",
                      "eos_token_id", "pad_token_id", "assistant_early_exit",
                      "num_assistant_tokens", "speculate",
                      "speculation_stats", "generation_config"}

# the output field that carries the cache: "cache" in recent transformers, "past_key_values" before
CACHE_FIELD = ("cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__
               else "past_key_values")


def stage_states(stages) -> tuple[torch.Tensor, ...]:
    """`output_hidden_states`: the stage boundaries of a looped model, each (B, T, d): the
    embeddings, the prelude's output, the state after every loop step (h¹ … h^K) and the coda's
    output (before the final norm). A looped layer has no single output per unrolled layer index, so
    these are the states a probe reads."""
    return (stages.embeddings, stages.prelude, *stages.states[1:], stages.coda)


class MeshForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MeshConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    # every layer class
    _no_split_modules = [backbone.layer.__name__ for backbone in BACKBONES.values()]
    _supports_sdpa = True  # attention always runs through F.scaled_dot_product_attention
    supports_gradient_checkpointing = True  # per layer, meshlm.model.recompute

    def __init__(self, config: MeshConfig):
        super().__init__(config)
        self.model = MeshLM(ModelConfig.from_dict(config.meshlm))
        if getattr(config, "meshlm_quantization", None):  # int8/int4 layers, weights follow
            empty_structure(self.model, config.meshlm_quantization)
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        # a non-persistent buffer: never in the weights file
        if isinstance(module, RotaryEmbedding):
            module.inv_freq.copy_(module.compute_inv_freq())

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None,
                                    every_n_layers: int = 1) -> None:
        """gradient_checkpointing_enable() / disable(): every layer (every_n_layers is not offered:
        a looped core layer is one module run K times), non-reentrant, per-loop LoRA passes restored
        on recompute."""
        checkpoint_layers(self.model, enable, gradient_checkpointing_func)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.embed_in

    def get_output_embeddings(self) -> torch.nn.Module | None:
        return self.model.embed_out  # None with tie_embeddings: meshlm ties inside the model

    def forward(
        self,
        input_ids: torch.Tensor,  # (B, T)
        attention_mask: torch.Tensor | None = None,  # (B, T_past + T), 1 = real token
        position_ids: torch.Tensor | None = None,  # (B, T)
        cache: object | None = None,
        labels: torch.Tensor | None = None,  # (B, T), -100 = no loss; shifted here
        use_cache: bool | None = None,
        logits_to_keep: int = 0,  # 0 = all positions, n = the last n
        past_key_values: object | None = None,  # older name of `cache`
        return_dict: bool | None = None,
        loops: int | None = None,  # loop steps (default: config.loops, else the trained K)
        # adaptive exit rule, e.g. "state:0.05" or an ExitRule (default: config.exit, else off)
        exit: str | ExitRule | None = None,
        output_hidden_states: bool | None = None,  # the stage boundaries (see hidden_states below)
        # refused: attention runs through SDPA, which returns no weights
        output_attentions: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("meshlm models take input_ids, not inputs_embeds")
        if output_attentions or (output_attentions is None and self.config.output_attentions):
            raise ValueError("meshlm attention runs through F.scaled_dot_product_attention, which "
                             "returns no attention weights; drop output_attentions "
                             "(meshlm.analysis.probes reads the states)")
        hidden = (output_hidden_states if output_hidden_states is not None
                  else self.config.output_hidden_states)
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("meshlm models take a 2D (batch, tokens) attention_mask; use the "
                             "default dynamic cache")
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache:
            cache = DynamicCache()
        targets = None
        if labels is not None:
            targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
        loops = loops if loops is not None else getattr(self.config, "loops", None)
        exit = exit if exit is not None else getattr(self.config, "exit", None)
        exit = None if exit is None else ExitRule.parse(exit)  # text from the config or a caller
        if (loops or exit) and isinstance(cache, DynamicCache) and cache.get_seq_length() == 0:
            # grows a slot per use: more loops and kl exit probes need more than the config's
            cache = DynamicCache()
        out = self.model(input_ids, targets=targets, padding_mask=attention_mask,
                         position_ids=position_ids,
                         cache=cache, loops=loops, exit=exit, return_states=bool(hidden))
        logits = out.logits[:, -logits_to_keep:] if logits_to_keep else out.logits
        result = CausalLMOutputWithPast(loss=out.loss, logits=logits, **{CACHE_FIELD: cache},
                                        hidden_states=stage_states(out.stages) if hidden else None)
        return result if return_dict is not False else result.to_tuple()

    def generate(self, inputs: torch.Tensor | None = None, **kwargs):
        """transformers' generate(), plus lossless self-speculative decoding
        (meshlm.generate.speculative).

        Speculation is asked for with `speculate="auto" | "K_d" | "K_d:γ"`, or with transformers'
        early-exit assistant knobs: `assistant_early_exit=K_d` (loop passes here, not layers) and
        `num_assistant_tokens=γ`. transformers' own early-exit assistant cannot share the looped
        cache slots, so it would recompute the shallow loops; this path reuses them. It takes
        input_ids, attention_mask (left padding), max_new_tokens, do_sample, temperature, top_k,
        top_p, eos/pad ids and a `generation_config` (which, else the model's own generation config,
        supplies what is not passed, the assistant knobs included); any other argument is refused.
        `speculation_stats` (a SpeculationStats) receives acceptance and speed. Returns (B, T + new)
        ids, finished rows padded with pad_token_id, as generate() does."""
        # a passed one wins, field by field
        configs = [kwargs.get("generation_config"), self.generation_config]

        def get(name):
            values = [kwargs.get(name)] + [getattr(cfg, name, None) for cfg in configs]
            return next((value for value in values if value is not None), None)

        speculate, early = kwargs.get("speculate"), get("assistant_early_exit")
        if speculate is None and early is not None:
            gamma = get("num_assistant_tokens")
            speculate = f"{early}:{gamma}" if gamma else f"{early}"
        if speculate is None:
            return super().generate(inputs,
                                    **{k: v for k, v in kwargs.items() if k != "speculation_stats"})
        unknown = sorted(set(kwargs) - SPECULATIVE_KWARGS)
        if unknown:
            raise ValueError(f"speculative generate() does not take {unknown}; drop them, or drop "
                             "speculate / assistant_early_exit for transformers' generate()")
        ids = inputs if inputs is not None else kwargs["input_ids"]
        mask = kwargs.get("attention_mask")
        prompts = [row[m.bool()].tolist()
                   for row, m in zip(ids, torch.ones_like(ids) if mask is None else mask)]
        eos, pad = get("eos_token_id"), get("pad_token_id")
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        sampled = bool(get("do_sample"))
        s = Sampling(max_new_tokens=get("max_new_tokens") or 20,
                     temperature=(get("temperature") or 1.0) * sampled,
                     top_k=(get("top_k") or 0) * sampled,
                     top_p=(get("top_p") or 1.0) if sampled else 1.0,
                     stop_at_eos=eos is not None)
        stats = kwargs.get("speculation_stats") or SpeculationStats()
        new = list(speculative_stream(self.model, prompts, s, Speculation.parse(speculate),
                                      -1 if eos is None else eos,
                                      eos if pad is None else pad, stats=stats))
        return torch.cat([ids, torch.stack(new, 1).to(ids.device)], 1)

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        """Save weights (safetensors) and config, plus the self-contained code that `auto_map`
        names."""
        self.config.auto_map = {"AutoConfig": "configuration_meshlm.MeshConfig",
                                "AutoModelForCausalLM": "modeling_meshlm.MeshForCausalLM"}
        super().save_pretrained(save_directory, *args, **kwargs)
        write_remote_code(save_directory)
