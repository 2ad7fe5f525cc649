"""TrainConfig: defaults, YAML files, dotted overrides, one ConfigError for every problem, configs/
parse."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from meshlm.errors import ConfigError
from meshlm.model import MeshLM
from meshlm.train.config import SHIPPED_CONFIGS, TrainConfig, find_config, load_config
from meshlm.train.optim import CosineSchedule, param_groups

# training configs
CONFIGS = sorted(p for d in ("paper", "cpu") for p in (SHIPPED_CONFIGS / d).rglob("*.yaml"))


def test_defaults_follow_the_paper_recipe():
    cfg = TrainConfig()
    assert cfg.betas == [0.9, 0.95] and cfg.eps == 1e-8 and cfg.weight_decay == 0.01
    assert cfg.warmup == 0.01 and cfg.min_lr_ratio == 0.1 and cfg.grad_clip == 1.0
    assert cfg.derive_model().scheme == "mesh"


def test_dotted_overrides_are_typed_and_nested():
    cfg = load_config(None, ["model.d_model=128", "model.scheme_options.slots=4", "train.lr=1e-3",
                             "steps=7", "compile=true", "betas=[0.8, 0.9]"])
    assert cfg.model == {"preset": "mesh-small", "d_model": 128, "scheme_options": {"slots": 4}}
    assert cfg.lr == 1e-3 and isinstance(cfg.lr, float) and cfg.steps == 7 and cfg.compile == "true"
    assert cfg.betas == [0.8, 0.9]
    assert cfg.derive_model().d_model == 128 and cfg.derive_model().scheme_options == {"slots": 4}


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("model:\n  preset: tiny\n  vocab_size: 8192\ntrain:\n  lr: 6e-4\n  seq_len: "
                    "64\n")
    cfg = load_config(path, ["train.seq_len=32"])
    assert cfg.lr == 6e-4 and cfg.seq_len == 32 and cfg.derive_model().d_model == 64


def test_every_problem_in_one_error():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["lr=-1", "micro_batch=3", "distributed=tp", "model.n_heads=5"])
    message = str(err.value)
    for needle in ("lr=-1", "multiple of micro_batch=3", "distributed='tp'", "n_heads=5"):
        assert needle in message
    assert "\n" not in message


@pytest.mark.parametrize("overrides, needle", [
    (["seq_len=4096"], "exceeds the model's context_length"),
    (["nonsense=1"], "unknown train field"),
    (["lr"], "not key=value"),
    (["steps=1.5"], "steps=1.5"),
    (["model.preset=nope"], "unknown preset"),
])
def test_bad_overrides(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)


def test_missing_or_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("optimizer: {}\n")
    with pytest.raises(ConfigError, match="unknown"):
        load_config(bad)


def test_file_dict_round_trip():
    cfg = load_config(None, ["model.scheme=anchor*", "lr=1e-3"])
    assert TrainConfig.from_file_dict(yaml.safe_load(yaml.safe_dump(cfg.to_file_dict()))) == cfg


def test_configs_exist_for_every_paper_row():
    names = {p.stem for p in CONFIGS}
    for size, specs in {"160m": ["2+4R2+2"], "410m": ["4+8R2+4", "3+6R3+3"], "1b": ["3+5R2+3"],
                        "1.4b": ["4+8R2+4"]}.items():
        assert f"{size}-vanilla" in names
        for spec in specs:
            for scheme in ("base", "residual", "anchor", "anchor-emb", "mesh"):
                assert f"{size}-{spec}-{scheme}" in names


@pytest.mark.parametrize("path", CONFIGS,
                         ids=[str(p.relative_to(SHIPPED_CONFIGS)) for p in CONFIGS])
def test_every_config_file_parses_and_builds(path):
    cfg = load_config(path)
    model_cfg = cfg.derive_model()
    with torch.device("meta"):
        model = MeshLM(model_cfg)
    assert sum(p.numel() for p in model.parameters()) > 0
    assert cfg.sequence_length(model_cfg) <= model_cfg.context_length
    if "paper" in path.parts:
        assert (cfg.seq_len, cfg.global_batch, cfg.tokenizer) == (4096, 512, "pythia")


def test_weight_decay_groups():
    model = MeshLM(load_config(None, ["model.preset=tiny"]).derive_model())
    decay, no_decay = param_groups(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert any(".routers." in n and n.endswith("weight") for n in decayed)  # MeSH routers decay
    assert not any(n.endswith("bias") or "layernorm" in n or "layer_norm" in n for n in decayed)
    assert no_decay["weight_decay"] == 0.0


def test_cosine_schedule_shape():
    s = CosineSchedule(total_steps=200, warmup=0.01, min_ratio=0.1)
    assert s.warmup_steps == 2 and s(0) == 0.5 and s(1) == 1.0 and s(2) == 1.0
    assert s(199) == pytest.approx(0.1) and s(100) == pytest.approx(0.55, abs=0.01)


def test_shipped_configs_resolve_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here
    shipped = SHIPPED_CONFIGS / "cpu" / "small-anchor.yaml"
    for name in ("cpu/small-anchor.yaml", "configs/cpu/small-anchor.yaml", "cpu/small-anchor"):
        assert find_config(name) == shipped, name
    assert load_config("cpu/small-anchor.yaml").name == "small-anchor"
    assert find_config("studies/quick") == SHIPPED_CONFIGS / "studies" / "quick.yaml"
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "small-anchor.yaml").write_text("train: {name: mine}\n")
    assert load_config("cpu/small-anchor.yaml").name == "mine"  # a file that exists as given wins
    with pytest.raises(ConfigError,
                       match="cpu/nothing.yaml does not exist, here or among the shipped configs"):
        load_config("cpu/nothing.yaml")


def test_the_repository_configs_folder_is_the_shipped_one():
    root = Path(__file__).resolve().parents[1]
    assert (root / "configs").resolve() == SHIPPED_CONFIGS.resolve()


def test_resume_sees_no_change_in_naming_the_run_it_resumes():
    from meshlm.train.preflight import changed_settings

    saved = {"name": "", "lr": 1e-3, "steps": 10}
    assert changed_settings(saved, {"name": "mesh-small-mesh", "lr": 1e-3, "steps": 10},
                            "mesh-small-mesh") == []
    assert changed_settings({**saved, "name": "mesh-small-mesh"}, {**saved},
                            "mesh-small-mesh") == []
    assert changed_settings(saved, {"name": "", "lr": 2e-3, "steps": 20}, "run") == ["lr", "steps"]
