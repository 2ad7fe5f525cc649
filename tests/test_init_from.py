"""`train.init_from`: continue training from a retrofitted, converted or finished checkpoint —
weights, model config and tokenizer from the checkpoint, a fresh optimizer and schedule, and clear
errors when they do not fit."""
from __future__ import annotations

import json

import pytest
import torch
from trainkit import tiny_train

from meshlm.cli import main
from meshlm.errors import CheckpointError, ConfigError
from meshlm.folders import integrity
from meshlm.loading import open_model
from meshlm.train.plan import resolve
from meshlm.train.trainer import Trainer, train


@pytest.fixture(scope="module")
def retrofitted(llama_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("retrofit") / "mesh"
    assert (main(["retrofit", str(llama_folder[0]), str(out), "--spec", "1+1R2+1", "--core-init",
                  "block"]) == 0)
    return out


def continued(prepared, tmp_path, init, **overrides):
    overrides = {"model": {"preset": "mesh-small"}, "init_from": str(init), "seq_len": 32,
                 **overrides}
    return tiny_train(prepared, tmp_path, **overrides)


def test_starts_from_the_checkpoint_weights_with_its_config(prepared, tmp_path, retrofitted):
    cfg = continued(prepared, tmp_path, retrofitted)
    source = open_model(retrofitted).model
    # the default preset is ignored: the architecture is the checkpoint's
    assert resolve(cfg).model == source.config
    fresh = trainer(cfg)
    for name, tensor in source.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[name], tensor), name
    assert fresh.step == 0 and fresh.scheduler.last_epoch == 0 and not fresh.optimizer.state


def test_a_retrofitted_llama_mesh_model_trains_and_keeps_its_tokenizer(prepared, tmp_path,
                                                                       retrofitted):
    result = train(continued(prepared, tmp_path, retrofitted, steps=12, micro_batch=8,
                             save_every=6))
    losses = [result.losses[s] for s in sorted(result.losses)]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3, losses
    model = open_model(result.run_dir).model
    assert (model.config.backbone, model.config.scheme, model.config.spec) == ("llama", "mesh",
                                                                               "1+1R2+1")
    # the source's own tokenizer.json travels with every checkpoint, so the run stands alone
    meta = json.loads((result.checkpoint / integrity.CONFIG).read_text())
    files = json.loads((result.checkpoint / integrity.MANIFEST).read_text())["files"]
    assert meta["tokenizer"] == "tokenizer.json" and "tokenizer.json" in files
    assert open_model(result.run_dir).tokenizer_source == str(result.checkpoint / "tokenizer.json")
    integrity.verify(result.checkpoint)


def test_resume_continues_the_run_not_the_initial_weights(prepared, tmp_path, retrofitted):
    cfg = continued(prepared, tmp_path, retrofitted, steps=8, save_every=4)
    first = train(cfg)
    again = trainer(continued(prepared, tmp_path, retrofitted, steps=12, save_every=4), resume=True)
    assert again.step == 8
    saved = open_model(first.run_dir).model.state_dict()
    assert all(torch.equal(again.model.state_dict()[n], t) for n, t in saved.items())


def test_model_overrides_that_keep_the_weights_apply(prepared, tmp_path, retrofitted):
    cfg = continued(prepared, tmp_path, retrofitted,
                    model={"aux_loss_weight": 0.05, "context_length": 128})
    model_cfg = resolve(cfg).model
    assert (model_cfg.aux_loss_weight, model_cfg.context_length) == (0.05, 128)
    trainer(cfg)  # rotary positions: a longer context needs no new weights


def test_what_does_not_fit_is_one_clear_error(prepared, tmp_path, retrofitted):
    with pytest.raises(CheckpointError, match="do not fit the model.*missing.*retrofit"):
        trainer(continued(prepared, tmp_path, retrofitted, model={"scheme": "base"}))
    with pytest.raises(ConfigError, match="drop model.preset=tiny"):
        resolve(continued(prepared, tmp_path, retrofitted, model={"preset": "tiny"}))
    with pytest.raises(ConfigError, match="init_from.*nowhere is not a directory"):
        resolve(continued(prepared, tmp_path, tmp_path / "nowhere"))


def test_cli_continues_a_finished_run(prepared, tmp_path, capsys):
    first = train(tiny_train(prepared, tmp_path, steps=4, save_every=0))
    code = main(["train", f"train.init_from={first.run_dir}", f"train.data={prepared}",
                 f"train.out_dir={tmp_path}",
                 "train.name=more", "train.steps=2", "train.seq_len=32", "train.global_batch=4",
                 "train.micro_batch=4", "train.eval_windows=4", "train.progress=false",
                 "train.tensorboard=false"])
    assert code == 0
    assert "initialised from" in capsys.readouterr().err
    assert open_model(tmp_path / "more").model.config == open_model(first.run_dir).model.config


def trainer(cfg, resume: bool = False) -> Trainer:
    from meshlm.train import parallel

    plan = resolve(cfg)
    return Trainer(plan, parallel.setup(plan), resume=resume)
