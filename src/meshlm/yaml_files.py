"""Reading config and study files: YAML whose mappings may not repeat a key.

PyYAML keeps the last of two equal keys without a word, so a `train:` section given twice (or `lr:`
twice in one section) silently dropped the first. Here it is a ConfigError naming the key and both
lines.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from meshlm.errors import ConfigError


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping with a repeated key."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise ConfigError(f"{loader.name}: key {key!r} appears twice (lines {seen[key]} and "
                              f"{line}); keep one")
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_yaml(path: Path, what: str = "") -> Any:
    """The YAML document in `path` (`what` names it in messages, e.g. "study file "); ConfigError
    for a repeated key, or YAML that does not parse."""
    loader = _StrictLoader(path.read_text())
    loader.name = f"{what}{path}"
    try:
        return loader.get_single_data()
    except yaml.YAMLError as err:
        raise ConfigError(f"{what}{path} is not valid YAML ({str(err).splitlines()[0]})") from None
    finally:
        loader.dispose()
