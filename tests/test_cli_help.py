"""The command line explains itself: field help from the config classes, the resolved config, "did
you mean", shell completion and the version."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from importlib.metadata import version

import pytest
import yaml

import meshlm
from meshlm.cli import main
from meshlm.config import ModelConfig
from meshlm.fielddocs import field_docs
from meshlm.train.config import TrainConfig, load_config


def help_text(capsys, *args) -> str:
    with pytest.raises(SystemExit):
        main([*args, "--help"])
    return capsys.readouterr().out


def test_train_help_lists_every_config_field_with_type_default_and_meaning(capsys):
    text = help_text(capsys, "train")
    for cls in (ModelConfig, TrainConfig):
        for f in dataclasses.fields(cls):
            assert f"  {f.name}: {f.type} = " in text, f.name
    assert "  lr: float = 0.004\n      peak learning rate" in text
    assert "  d_model: int = 256\n      hidden width" in text
    assert "mesh-small" in text  # the presets model.preset takes
    docs = {d.name: d for d in field_docs(TrainConfig)}
    # continued comment lines joined
    assert docs["init_from"].meaning.endswith("fresh optimizer and schedule")
    assert all(
        d.meaning for d in field_docs(ModelConfig)), [d.name for d in field_docs(ModelConfig)
                                                      if not d.meaning]


def test_print_config_expands_the_preset_and_trains_the_same(capsys, tmp_path):
    assert (main(["train", "model.preset=tiny", "model.d_model=96", "train.lr=1e-3",
                  "--print-config"]) == 0)
    printed = yaml.safe_load(capsys.readouterr().out)
    resolved = ModelConfig.from_preset("tiny", d_model=96)
    assert {k: printed["model"][k] for k in ("d_model", "n_heads", "spec", "scheme")} == {
        "d_model": 96, "n_heads": resolved.n_heads, "spec": resolved.spec,
        "scheme": resolved.scheme}
    assert set(printed["model"]) == {"preset"} | {f.name for f in dataclasses.fields(ModelConfig)}
    (tmp_path / "printed.yaml").write_text(yaml.safe_dump(printed))
    again = load_config(tmp_path / "printed.yaml")
    assert again.derive_model() == resolved and again.lr == 1e-3


def test_misspelt_fields_commands_presets_and_choices_suggest_the_nearest(capsys):
    assert main(["train", "lrr=1e-3", "--print-config"]) == 2
    assert "unknown train field(s) ['lrr'] (did you mean 'lr'?)" in capsys.readouterr().err
    assert main(["train", "model.d_modle=64", "--print-config"]) == 2
    assert "(did you mean 'd_model'?)" in capsys.readouterr().err
    assert main(["train", "model.preset=mesh-smal", "--print-config"]) == 2
    assert "unknown preset 'mesh-smal' (did you mean 'mesh-small'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["trian"])
    assert "(did you mean 'train'?)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "x", "--suite", "reasonin"])
    assert "(did you mean 'reasoning'?)" in capsys.readouterr().err


def test_version_is_the_installed_distributions(capsys):
    assert meshlm.__version__ == version("meshlm")
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"meshlm {meshlm.__version__}"


def complete(tmp_path, line: str) -> list[str]:
    """What bash completion offers for `line` (argcomplete's protocol, in a fresh interpreter)."""
    out = tmp_path / "completions"
    env = {**os.environ, "_ARGCOMPLETE": "1", "_ARGCOMPLETE_SHELL": "bash", "COMP_LINE": line,
           "COMP_POINT": str(len(line)), "_ARGCOMPLETE_STDOUT_FILENAME": str(out),
           "_ARGCOMPLETE_IFS": "\n"}
    done = subprocess.run([sys.executable, "-m", "meshlm.cli"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return [word.strip() for word in out.read_text().split("\n")]  # a lone match ends with a space


@pytest.mark.slow  # three fresh interpreters
def test_shell_completion_offers_commands_options_and_config_fields(tmp_path):
    assert "train" in complete(tmp_path, "meshlm tr")
    assert "--print-config" in complete(tmp_path, "meshlm train --pr")
    offered = complete(tmp_path, "meshlm train train.l")
    assert {"train.lr=", "train.log_every=", "train.loops="} <= set(offered)
