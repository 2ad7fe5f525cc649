"""`resolve(cfg) -> RunPlan`: what a training start derives from its TrainConfig, derived once.

    meshlm train --config FILE KEY=VALUE ...        meshlm.commands.train
        │ load_config: the file + overrides -> TrainConfig (plain data; its values checked)
        ▼
    resolve(cfg) -> RunPlan                         here: init_from located (its config.json read
        │                                           once), the model config built, the tokenizer
        │                                           chosen and loaded, the data folder named (task
        │                                           data generated into the cache), the sequence
        │                                           length, step count, loop distribution, run
        │                                           folder
        ▼
    preflight(plan) -> parallel.setup(plan) -> Trainer(plan, env).run()      meshlm.train.trainer

What resolve finds wrong with the config is one ConfigError worded as TrainConfig's own ("invalid
training config: ..."): an init_from that is no model folder, a model that does not build, a seq_len
beyond its context, a LoRA rank as wide as the layers it adapts. What needs the machine (the device,
free memory, the prepared data's contents, the run folder) is preflight's, and the embedded corpus
is prepared by the trainer (rank 0 first).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from meshlm.adapters import rank_problem
from meshlm.config import ModelConfig
from meshlm.data.tasks import data_folder, data_tokenizer
from meshlm.data.tokenizer import TextTokenizer, load_tokenizer, tokenizer_file
from meshlm.errors import CheckpointError, ConfigError
from meshlm.folders.locate import ModelFolder, locate
from meshlm.train.config import PREFIX, TrainConfig
from meshlm.train.depth import LoopDistribution


@dataclass(frozen=True)
class RunPlan:
    """A resolved training run: the config it came from and everything derived from it."""

    cfg: TrainConfig
    model: ModelConfig  # preset + overrides, or init_from's config + overrides; max_loops set
    init: ModelFolder | None  # train.init_from, located (weights are read when the model is built)
    tokenizer: TextTokenizer
    tokenizer_source: str  # "default", "pythia" or a tokenizer.json path (what checkpoints name)
    data_dir: Path | None  # the prepared folder; None: the embedded corpus, prepared at the start
    seq_len: int  # train.seq_len, else the context (example data: their block, train.data_source)
    total_steps: int
    loops: LoopDistribution  # train.loops: the loop count of each step
    run_dir: Path  # <out_dir>/<name>; the name defaults to "<preset>-<scheme>"
    # (file name, text) the trainer writes into the run folder once it owns it: what the run's
    # users need beside its checkpoints (fine-tuning: the chat template its data were rendered in)
    run_files: tuple[tuple[str, str], ...] = ()

    @property
    def tokenizer_file(self) -> Path | None:
        """The tokenizer.json checkpoints carry (None for "default", which every install has)."""
        return tokenizer_file(self.tokenizer_source)

    @property
    def varies_depth(self) -> bool:
        """Whether a step may run other than the spec's K with full backprop (train.loops sampled or
        fixed:N, or truncated backprop): the step passes its depth and counts its FLOPs."""
        return self.loops.sampled or bool(self.loops.low) or self.cfg.backprop_loops > 0

    def with_data(self, data_dir: Path, run_files: tuple[tuple[str, str], ...] = ()) -> RunPlan:
        """The same run on data prepared after resolving (fine-tuning data, made with its
        tokenizer), with the run files that go with those data."""
        cfg = dataclasses.replace(self.cfg, data=str(data_dir))
        return dataclasses.replace(self, cfg=cfg, data_dir=data_dir,
                                   run_files=self.run_files + run_files)


def resolve(cfg: TrainConfig) -> RunPlan:
    """The run `cfg` describes, resolved once for a training start (module docstring)."""
    model, init = resolve_model(cfg)
    data_dir = data_folder(cfg.data)  # a task: source is generated here (once, into the cache)
    source, tokenizer = _tokenizer(cfg, init, data_dir)
    name = cfg.name or f"{cfg.model.get('preset', 'custom')}-{model.scheme}".replace("*", "-emb")
    return RunPlan(cfg, model, init, tokenizer, source, data_dir, cfg.sequence_length(model),
                   cfg.total_steps(model), cfg.loop_distribution(), Path(cfg.out_dir) / name)


def resolve_model(cfg: TrainConfig) -> tuple[ModelConfig, ModelFolder | None]:
    """The model config a run trains and the init_from folder it starts from (None without one):
    all `meshlm train --print-config` and a study's estimates need (no tokenizer, no data)."""
    try:  # first: a folder that is not there is the problem, whatever else is set
        init = locate(cfg.init_from) if cfg.init_from else None
        model = cfg.derive_model(init.model_config().to_dict() if init else None)
    except CheckpointError as err:
        raise ConfigError(f"{PREFIX}train.init_from: {err}") from None
    except ConfigError as err:  # the preset or the folder's config, with the overrides on it
        raise ConfigError(PREFIX + str(err)) from None
    # resource bounds up front: a LoRA rank as wide as its layers
    if problems := [*cfg.fit_problems(model), *filter(None, [rank_problem(model, cfg.to_dict())])]:
        raise ConfigError(PREFIX + "; ".join(problems))
    return model, init


def _tokenizer(cfg: TrainConfig, init: ModelFolder | None,
               data_dir: Path | None) -> tuple[str, TextTokenizer]:
    """(source, loaded tokenizer): train.tokenizer, else init_from's own (the tokenizer rule of
    meshlm.folders.locate), else the one task data carry, else "default". A train.tokenizer that
    encodes unlike init_from's is a ConfigError unless train.force_tokenizer."""
    if init is not None and cfg.tokenizer != "default":
        return cfg.tokenizer, init.chosen_tokenizer(cfg.tokenizer, cfg.force_tokenizer,
                                                    "train.tokenizer", "train.force_tokenizer=true")
    if init is not None:
        source = init.require_tokenizer()
    elif cfg.tokenizer == "default":
        source = data_tokenizer(data_dir) or "default"
    else:
        source = cfg.tokenizer
    return source, load_tokenizer(source)
