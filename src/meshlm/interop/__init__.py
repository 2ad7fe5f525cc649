"""Interop with other model families: Hugging Face folder conversion (GPT-NeoX, Llama, OLMoE) and retrofit."""
