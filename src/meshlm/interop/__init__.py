"""Interop with other model families: Hugging Face folders (GPT-NeoX, Llama, OLMoE, meshlm's own
MeshForCausalLM), read by the adapters below the loader (families here, meshlm.folders.formats),
and conversion and retrofit above it (convert, retrofit: they open their source with
meshlm.loading)."""
from meshlm.backbones import BACKBONES

FORMATS = ("meshlm", "hf", *BACKBONES)  # the one format list; a backbone name: its family folders
