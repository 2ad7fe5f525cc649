"""ModelConfig: spec parsing, presets, validation messages, JSON round trip."""
import json

import pytest

from meshlm.config import PRESETS, ModelConfig, parse_spec
from meshlm.errors import ConfigError


@pytest.mark.parametrize("spec, prelude, cores, repeats, coda, unique, unrolled, steps", [
    ("4+8R2+4", 4, (8,), (2,), 4, 16, 24, 2),
    ("3+6r3+3", 3, (6,), (3,), 3, 12, 24, 3),
    ("4+8+8+4", 4, (8, 8), (1, 1), 4, 24, 24, 2),
    ("24", 0, (24,), (1,), 0, 24, 24, 1),
    ("0+2R3+0", 0, (2,), (3,), 0, 2, 6, 3),
    ("1+2R2+3R2+1", 1, (2, 3), (2, 2), 1, 7, 12, 4),
])
def test_parse_spec(spec, prelude, cores, repeats, coda, unique, unrolled, steps):
    layout = parse_spec(spec)
    assert (layout.prelude, layout.cores, layout.repeats, layout.coda) == (prelude, cores, repeats,
                                                                           coda)
    assert (layout.unique_depth, layout.unrolled_depth, layout.n_steps) == (unique, unrolled, steps)


def test_schedule_orders_cores():
    assert parse_spec("4+8R2+4").schedule == (0, 0)
    assert parse_spec("4+8+8+4").schedule == (0, 1)
    assert parse_spec("1+2R2+3+1").schedule == (0, 0, 1)


@pytest.mark.parametrize("spec", ["abc", "4+8R0+4", "4+0+4", "4+8", "", "4++4", "a+8R2+4",
                                  "4+8R2+x", "4+R2+4",
                                  "4+8R2R2+4", "-1+8+4"])
def test_malformed_specs_are_rejected_with_the_grammar(spec):
    with pytest.raises(ConfigError, match=r'P\+CrK\+D'):
        ModelConfig(spec=spec)


def test_every_bad_field_is_named_in_one_message():
    with pytest.raises(ConfigError) as info:
        ModelConfig(spec="4+8R0+4", d_model=100, n_heads=3, vocab_size=0, scheme="mesh",
                    scheme_options={"slots": 1}, rotary_pct=1.5, context_length=-1)
    message = str(info.value)
    assert "\n" not in message
    for needle in ["spec '4+8R0+4'", "n_heads=3 must divide d_model=100", "vocab_size=0", "slots=1",
                   "rotary_pct=1.5", "context_length=-1"]:
        assert needle in message, needle


def test_unknown_scheme_lists_the_valid_ones():
    with pytest.raises(ConfigError, match="scheme='nope' is unknown; choose one of: .*mesh"):
        ModelConfig(scheme="nope")


def test_unknown_scheme_option_is_rejected():
    message = r"\['buffer'\] are not options of scheme 'mesh' \(valid: \['routing', 'slots'\]\)"
    with pytest.raises(ConfigError, match=message):
        ModelConfig(scheme="mesh", scheme_options={"buffer": 4})
    with pytest.raises(ConfigError, match="not options of scheme 'anchor'"):
        ModelConfig(scheme="anchor", scheme_options={"slots": 4})


def test_vanilla_refuses_a_looped_core():
    with pytest.raises(ConfigError, match="use scheme 'base'"):
        ModelConfig(spec="4+8R2+4", scheme="vanilla")
    ModelConfig(spec="4+8+8+4", scheme="vanilla")


def test_mix_alpha_init_is_checked():
    with pytest.raises(ConfigError, match="alpha_init"):
        ModelConfig(scheme="static-mix", scheme_options={"alpha_init": [1, 2]})


def test_json_round_trip_and_unknown_fields():
    cfg = ModelConfig.from_preset("pythia-410m-3+6R3+3", scheme_options={"slots": 6})
    again = ModelConfig.from_dict(json.loads(cfg.to_json()))
    assert again == cfg
    with pytest.raises(ConfigError, match="unknown model config field"):
        ModelConfig.from_dict({**cfg.to_dict(), "dmodel": 3})


def test_presets_cover_every_pythia_size_and_paper_split():
    for size in ["70m", "160m", "410m", "1b", "1.4b", "2.8b", "6.9b"]:
        assert PRESETS[f"pythia-{size}"]["scheme"] == "vanilla"
    for name in ["pythia-160m-2+4R2+2", "pythia-410m-4+8R2+4", "pythia-410m-3+6R3+3",
                 "pythia-1b-3+5R2+3",
                 "pythia-1.4b-4+8R2+4", "pythia-1.4b-4+8+8+4"]:
        assert ModelConfig.from_preset(name).scheme == "mesh"
    for name in PRESETS:  # every preset validates
        ModelConfig.from_preset(name)
    with pytest.raises(ConfigError, match=r"unknown preset 'pythia-3b' \(did you mean "
                                          r"'pythia-1b', .*\); choose"):
        ModelConfig.from_preset("pythia-3b")


def test_anchor_star_alias_is_accepted():
    assert ModelConfig(scheme="anchor*").scheme == "anchor*"
