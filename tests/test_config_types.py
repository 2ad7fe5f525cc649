"""Strict config types: every model.* and train.* field refuses a value of the wrong type with a
ConfigError naming it, all problems come in one message, and no spec string, override or YAML
document gets past the config as anything but a valid config or a ConfigError (property tests with
hypothesis)."""
from __future__ import annotations

import dataclasses

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshlm.config import ModelConfig, parse_spec
from meshlm.errors import ConfigError
from meshlm.fields import kinds
from meshlm.train.config import TrainConfig, load_config

WRONG = {  # annotation -> values of another type that must be refused
    "bool": [1, 0, "on", 2.5, [True]],
    "int": [True, 1.5, "ten", [1], {"a": 1}, float("nan")],
    "float": [True, "fast", [0.1], float("inf"), None],
    "str": [True, 1.5, [1], {"a": 1}],
    "list[float]": [0.9, "0.9,0.95", ["a", "b"]],
    "dict[str, Any]": ["slots=4", [1], 3],
}
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _cases(cls):
    for name, kind in kinds(cls).items():
        base = kind.replace(" | None", "")
        for value in WRONG.get(base, []):
            if value is None and kind.endswith("| None"):
                continue
            if cls is TrainConfig and name in ("name", "init_from") and value is None:
                continue
            if cls is TrainConfig and name == "compile" and isinstance(value, bool):
                # compile is "auto", "true" or "false"; YAML's true/false mean the last two
                continue
            yield name, value


@pytest.mark.parametrize("name, value", list(_cases(ModelConfig)))
def test_every_model_field_refuses_a_wrong_type(name, value):
    with pytest.raises(ConfigError, match=rf"\b{name}="):
        ModelConfig.from_dict({"spec": "1+2R2+1", name: value} if name != "spec" else {name: value})


@pytest.mark.parametrize("name, value", list(_cases(TrainConfig)))
def test_every_train_field_refuses_a_wrong_type(name, value):
    with pytest.raises(ConfigError, match=rf"\b{name}="):
        TrainConfig.from_dict({name: value})


def test_direct_construction_is_as_strict():
    with pytest.raises(ConfigError, match="tie_embeddings=1 must be true or false"):
        ModelConfig(tie_embeddings=1)
    with pytest.raises(ConfigError, match="progress='yes' must be true or false"):
        TrainConfig(progress="yes")


def test_floats_and_integers_parse_from_yaml_strings():
    cfg = load_config(None, ["train.lr=1e-3", "model.layer_norm_eps=1e-6", "train.steps=1e2",
                             "model.spec=24",
                             "model.scheme=vanilla", "train.progress=false"])
    assert cfg.lr == 1e-3 and cfg.steps == 100 and cfg.progress is False
    model = cfg.derive_model()
    assert model.layer_norm_eps == 1e-6 and model.spec == "24"
    # YAML 1.1: both strings
    data = yaml.safe_load("model:\n  layer_norm_eps: 1e-5\ntrain:\n  eps: 1e-8\n")
    cfg = TrainConfig.from_file_dict(data)
    assert cfg.eps == 1e-8 and cfg.derive_model().layer_norm_eps == 1e-5


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(None,
                    ["train.progress=1", "train.lr=fast", "train.steps=1.5", "train.micro_batch=0",
                     "model.d_model=x", "model.tie_embeddings=2", "model.n_heads=0",
                     "model.spec=4R0"])
    message = str(err.value)
    for needle in ("progress=1", "lr='fast'", "steps=1.5", "micro_batch=0", "d_model='x'",
                   "tie_embeddings=2",
                   "n_heads=0", "4R0"):
        assert needle in message, needle
    assert len(message.splitlines()) == 1


def test_the_renamed_eval_batches_says_what_replaced_it():
    with pytest.raises(ConfigError, match="eval_windows = old eval_batches × micro_batch"):
        load_config(None, ["train.eval_batches=16"])


def test_non_mapping_sections_are_config_errors(tmp_path):
    for text in ("model: tiny\n", "train: [1, 2]\n", "- a\n- b\n"):
        path = tmp_path / "c.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError):
            load_config(path)


# -- properties ------------------------------------------------------------------------------------
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=6),
                                        inner, max_size=3),
                      max_leaves=6)
MODEL_FIELDS = st.sampled_from(sorted(kinds(ModelConfig)))
TRAIN_FIELDS = st.sampled_from(sorted(kinds(TrainConfig)))


@SETTINGS
@given(st.text(max_size=20))
def test_any_spec_string_parses_or_is_a_config_error(spec):
    try:
        layout = parse_spec(spec)
    except ConfigError:
        return
    assert layout.unrolled_depth >= layout.unique_depth >= 0


@SETTINGS
@given(st.integers(0, 6),
       st.lists(st.tuples(st.integers(1, 9), st.integers(1, 4)), min_size=1, max_size=3),
       st.integers(0, 6))
def test_generated_specs_round_trip(prelude, cores, coda):
    body = "+".join(f"{c}R{k}" if k > 1 else str(c) for c, k in cores)
    spec = f"{prelude}+{body}+{coda}"
    layout = parse_spec(spec)
    assert (layout.prelude, layout.coda) == (prelude, coda)
    assert list(zip(layout.cores, layout.repeats)) == cores


@SETTINGS
@given(st.dictionaries(MODEL_FIELDS, VALUES, max_size=4))
def test_any_model_dict_is_a_config_or_a_config_error(data):
    try:
        cfg = ModelConfig.from_dict({"spec": "1+2R2+1", "d_model": 64, "n_heads": 4, **data})
    except ConfigError as err:
        assert "\n" not in str(err)
        return
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg  # what was accepted round-trips


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(["", "model.", "train."]), TRAIN_FIELDS | MODEL_FIELDS,
                          st.text(max_size=10)), max_size=4))
def test_any_overrides_give_a_config_or_a_config_error(items):
    overrides = [f"{prefix}{key}={raw}" for prefix, key, raw in items]
    try:
        cfg = load_config(None, overrides)
    except ConfigError:
        return
    again = TrainConfig.from_dict(cfg.to_dict())
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)


@SETTINGS
@given(st.dictionaries(st.sampled_from(["model", "train", "extra"]),
                       st.one_of(VALUES,
                                 st.dictionaries(TRAIN_FIELDS | MODEL_FIELDS, VALUES, max_size=4)),
                       max_size=2))
def test_any_yaml_document_gives_a_config_or_a_config_error(tmp_path_factory, document):
    path = tmp_path_factory.mktemp("yaml") / "config.yaml"
    try:
        path.write_text(yaml.safe_dump(document))
    except (yaml.YAMLError, UnicodeEncodeError):
        return
    try:
        load_config(path)
    except ConfigError:
        pass
