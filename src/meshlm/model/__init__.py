"""The meshlm model: the layer kinds (GPT-NeoX, Llama, OLMoE MoE), the loop, the state schemes and MeSH."""
from meshlm.model.lm import LMOutput, MeshLM, Stages
from meshlm.model.memory import MeSH
from meshlm.model.schemes import SCHEMES

__all__ = ["SCHEMES", "LMOutput", "MeSH", "MeshLM", "Stages"]
