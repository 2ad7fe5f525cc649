"""meshlm.train.plan: a training start resolves its run once (counted through a real
`meshlm train`), and the plan holds what preflight, parallel and the Trainer use."""
from __future__ import annotations

import pytest
from trainkit import tiny_train

from meshlm import loading
from meshlm.cli import main
from meshlm.errors import ConfigError
from meshlm.folders import locate as locating
from meshlm.train import plan as plan_module
from meshlm.train import trainer as trainer_module
from meshlm.train.config import TrainConfig
from meshlm.train.plan import resolve, resolve_model
from meshlm.train.trainer import train


def first_model(result):
    return loading.open_model(result.checkpoint).model.config


def counting(monkeypatch, owner, name: str) -> list[int]:
    """Replace owner.name by a wrapper that counts its calls; returns the (one-element) count."""
    calls, real = [0], getattr(owner, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


TINY = ["train.seq_len=32", "train.global_batch=4", "train.micro_batch=4", "train.steps=2",
        "train.eval_windows=4", "train.progress=false", "train.tensorboard=false",
        "train.peak_flops=1e11"]


def test_meshlm_train_from_init_from_resolves_the_run_once(prepared, tmp_path, monkeypatch):
    first = train(tiny_train(prepared, tmp_path, steps=2, save_every=0))
    derived = counting(monkeypatch, TrainConfig, "derive_model")
    resolved = counting(monkeypatch, plan_module, "resolve")
    again = counting(monkeypatch, trainer_module, "resolve")  # train() given a config resolves it
    located = counting(monkeypatch, plan_module, "locate")
    recognised = counting(monkeypatch, locating, "_recognise")  # a folder's config.json read
    code = main(["train", f"train.init_from={first.run_dir}", f"train.data={prepared}",
                 f"train.out_dir={tmp_path}", "train.name=more", *TINY])
    assert code == 0
    assert (resolved[0], again[0]) == (1, 0)  # one plan, from the command line to the trainer
    assert derived[0] == 1  # the model config: derived once (before: 8 times before step 0)
    assert located[0] == 1  # init_from: located once, for the plan ...
    assert recognised[0] == 1  # ... and its config.json read once: the trainer opens that folder


def test_train_given_a_config_resolves_it_once(prepared, tmp_path, monkeypatch):
    cfg = tiny_train(prepared, tmp_path, steps=2, save_every=0)  # validated: its model is data too
    derived = counting(monkeypatch, TrainConfig, "derive_model")
    resolved = counting(monkeypatch, trainer_module, "resolve")
    result = train(cfg)
    assert (resolved[0], derived[0]) == (1, 1) and result.steps == 2


def test_the_plan_holds_what_the_run_derives(prepared, tmp_path):
    cfg = tiny_train(prepared, tmp_path, name="", seq_len=0, steps=0, tokens=1000,
                     loops="uniform:1-4", global_batch=4, micro_batch=4)
    plan = resolve(cfg)
    assert plan.model == cfg.derive_model() and plan.model.max_loops == 4  # the loops horizon
    assert plan.seq_len == plan.model.context_length == 128  # seq_len 0: the context
    assert plan.total_steps == 2  # ceil(1000 tokens / (4 × 128))
    assert plan.run_dir == tmp_path / "tiny-mesh" and plan.data_dir == prepared
    assert (plan.tokenizer_source, plan.tokenizer.name) == ("default", "default")
    assert plan.tokenizer_file is None  # every install has the default tokenizer
    assert plan.loops.sampled and plan.varies_depth and plan.init is None
    moved = plan.with_data(tmp_path / "sft")
    assert moved.data_dir == tmp_path / "sft" and moved.cfg.data == str(tmp_path / "sft")
    assert moved.model == plan.model and cfg.data == str(prepared)  # the original is untouched


def test_what_only_the_folder_can_tell_is_found_when_resolving(prepared, tmp_path):
    first = train(tiny_train(prepared, tmp_path, steps=2, save_every=0))
    init = dict(model={}, init_from=str(first.run_dir))
    cfg = tiny_train(prepared, tmp_path, name="more", seq_len=4096, **init)
    # a plain config checks seq_len against its preset at once; init_from's context is the folder's
    with pytest.raises(ConfigError, match="^invalid training config: seq_len=4096 exceeds the "
                                          "model's context_length=128"):
        resolve_model(cfg)
    model, folder = resolve_model(tiny_train(prepared, tmp_path, name="x", **init))
    assert folder.path == first.checkpoint and model == first_model(first)
