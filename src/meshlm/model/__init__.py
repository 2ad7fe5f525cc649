"""The meshlm model: the layer kinds (GPT-NeoX, Llama, OLMoE MoE), the loop, the schemes and MeSH.

Importing it imports the layer module each registered backbone names (`Backbone.layer_module`),
whose `@layer_of` attaches the layer to the registry: the list of layer modules is the registry.
"""
from importlib import import_module

from meshlm.backbones import BACKBONES
from meshlm.model.lm import LMOutput, MeshLM
from meshlm.model.memory import MeSH
from meshlm.model.run import Stages
from meshlm.model.schemes import SCHEMES

__all__ = ["SCHEMES", "LMOutput", "MeSH", "MeshLM", "Stages"]


def attach_layers() -> None:
    """Import the layer module of each registered backbone without a layer; it must attach one."""
    for name, backbone in BACKBONES.items():
        if backbone.layer is None:
            import_module(backbone.layer_module)
        if backbone.layer is None:
            raise ValueError(f"backbone {name!r}: its layer_module {backbone.layer_module!r} "
                             f"attaches no layer; decorate its layer class with "
                             f"@layer_of({name!r})")


attach_layers()
