"""The training configuration: one flat, JSON/YAML-serialisable dataclass plus a model section.

A config file has two sections; every key is optional (the defaults are the CPU-scale default job):

    model:                      # a preset plus any ModelConfig field as an override
      preset: pythia-160m-2+4R2+2
      scheme: mesh
    train:                      # any TrainConfig field
      seq_len: 4096
      lr: 6.0e-4

Command-line overrides are dotted `key=value` pairs applied in order after the file:
`model.d_model=128`, `model.scheme_options.slots=4`, `train.lr=1e-3` (or just `lr=1e-3`). Values are
parsed as YAML scalars/lists and then coerced to the field's type, so `lr=1e-3` is a float even
though YAML 1.1 reads "1e-3" as a string (meshlm.train.overrides). Every problem is collected
into one ConfigError.

A TrainConfig is plain data: it imports neither torch nor the model, and reads no file but the
config file itself. What needs files (init_from's model config, the tokenizer, the data folder) is
derived once per training start by meshlm.train.plan.resolve, into the RunPlan that preflight,
parallel and the Trainer take.

Defaults follow the paper's recipe (docs/training.md): AdamW (0.9, 0.95), eps 1e-8, weight decay
0.01, cosine decay to 10% of peak after 1% warmup, grad clip 1.0.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshlm.config import ModelConfig
from meshlm.errors import ConfigError
from meshlm.fields import build, coerce_all, did_you_mean, type_problems, with_defaults
from meshlm.train.depth import LoopDistribution, parse_loops
from meshlm.train.overrides import apply_override
from meshlm.train.trackers import LOGGERS, parse_loggers
from meshlm.trainable import trainable_roles
from meshlm.yaml_files import load_yaml

SHIPPED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"  # cpu/, paper/, studies/
DISTRIBUTED = ("ddp", "fsdp")
DEFAULT_PRESET = "mesh-small"  # what `meshlm train` trains with no arguments
DTYPES = ("auto", "fp32", "bf16")
COMPILE = ("auto", "true", "false")
UNLABELLED = ("ignore", "next")  # train.unlabelled
PREFIX = "invalid training config: "


@dataclass
class TrainConfig:
    # -- what to train on -------------------------------------------------------------------------
    name: str = ""  # run name: checkpoints go to <out_dir>/<name>; "" -> "<preset>-<scheme>"
    out_dir: str = "runs"  # where run folders go: <out_dir>/<name>
    model: dict[str, Any] = field(default_factory=lambda: {"preset": DEFAULT_PRESET})  # preset +
    # overrides (the model fields above)
    data: str = "default"  # a prepared-data dir (`meshlm prepare`), "default" = the embedded
    # corpus, or a reasoning task source such as task:chase (meshlm.data.tasks: generated once into
    # the cache)
    tokenizer: str = "default"  # "default", "pythia" or a tokenizer.json; must match the prepared
    # data (task data's own tokenizer.json when left at "default"); with init_from, it must encode
    # like that folder's
    force_tokenizer: bool = False  # use train.tokenizer even though it encodes unlike
    # init_from's own
    init_from: str = ""  # start from the weights of any folder meshlm.loading opens (a run or step
    # dir, a `meshlm retrofit`/`convert` output, a Hugging Face folder or Hub name
    # org/name[@revision]): its model config (plus any model.* overrides) and its tokenizer
    # (meshlm.loading's rule; train.tokenizer other than "default" overrides it); fresh optimizer
    # and schedule
    # -- fine-tuning (meshlm.adapters) ------------------------------------------------------------
    lora_rank: int = 0  # PEFT LoRA on the lora_targets Linears, base weights frozen; 0 = no LoRA
    lora_alpha: float = 0.0  # adapters are scaled by alpha / rank; 0 -> 2 · rank
    lora_targets: str = "attention,mlp"  # roles (attention, mlp, prelude, core, coda, routers) or
    # Linear names
    lora_dropout: float = 0.0
    trainable: str = ""  # which parameters train: "all" or roles (lora, loop_lora, routers, scheme,
    # embeddings, prelude, core, coda); "" -> all without LoRA, the adapters with it
    # -- batch and length -------------------------------------------------------------------------
    seq_len: int = 0  # tokens per sequence; 0 -> the model's context_length
    global_batch: int = 8  # sequences per optimizer step, summed over every rank (8: best at CPU
    # scale)
    micro_batch: int = 8  # sequences per forward on one rank; accumulation = global / (world ×
    # micro)
    steps: int = 300  # optimizer steps; 0 -> derived from `tokens` (300 × 8 × 256)
    tokens: int = 0  # training tokens (used only when steps = 0)
    # -- depth (meshlm.train.depth) ---------------------------------------------------------------
    loops: str = "fixed"  # loop steps per training step: fixed, fixed:N, uniform:LO-HI,
    # poisson-lognormal:mean=M,cap=C
    backprop_loops: int = 0  # truncated backprop: only the last k loop passes keep autograd state;
    # 0 = all
    curriculum: int = 0  # task data: open one training difficulty every N steps, from the lowest
    # (meshlm.data.tasks.curriculum); 0 = every difficulty from the start
    unlabelled: str = "ignore"  # labelled task data: what a position without a label learns:
    # "ignore" (no loss) or "next" (its next token, as on text: a target everywhere, so no
    # position's readout is left free to drift; docs/reasoning.md)
    reveal: int = 0  # labelled task data: hide each sequence's given values (inputs that are also
    # labels) from the loop for its first s steps, s uniform in 0..reveal, so the step count stops
    # saying when an answer resolves (meshlm.train.reveal; a re-injecting scheme such as anchor)
    # -- optimizer and schedule (docs/training.md) -------------------------------------------------
    lr: float = 4e-3  # peak learning rate (the default small model; the paper configs set theirs)
    min_lr_ratio: float = 0.1  # cosine decays to this fraction of the peak
    warmup: float = 0.01  # fraction of the steps spent in linear warmup
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.01  # on matrices (incl. MeSH routers); none on biases and LayerNorm
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    seed: int = 0
    # -- evaluation, checkpoints, logging ---------------------------------------------------------
    eval_every: int = 100  # steps between validation passes (also at the end); 0 -> only at the end
    eval_windows: int = 128  # validation windows per pass, spread evenly over the split (all if
    # fewer); a fixed set, so the reported loss does not depend on micro_batch or the world size
    save_every: int = 100  # steps between checkpoints (also at the end); 0 -> only at the end
    keep_last: int = 3  # checkpoints kept besides the best; >= 2 keeps a fallback for a corrupt
    # latest
    log_every: int = 1  # steps between metrics lines
    progress: bool = True  # tqdm progress bar on rank 0
    loggers: str = "tensorboard"  # trackers beside metrics.jsonl, comma-separated: tensorboard,
    # wandb, mlflow, csv (or none); each gets the run's settings as hyperparameters
    # (meshlm.train.trackers)
    tensorboard: bool = True  # false drops tensorboard from train.loggers (the older switch)
    peak_flops: float = 0.0  # per-device peak FLOP/s for MFU; 0 -> measured (CPU) or looked up
    # (GPU)
    max_nonfinite: int = 5  # abort after this many non-finite steps in a row
    # -- how to run -------------------------------------------------------------------------------
    device: str = "auto"  # "auto" (cuda if available, else cpu), "cpu", "cuda"
    dtype: str = "auto"  # "auto": bf16 autocast where the CPU/GPU has native bf16, else fp32
    # (meshlm.runtime.precision)
    compile: str = "auto"  # torch.compile each layer: "true", "false", or "auto": only where it
    # pays (meshlm.runtime.compile: on GPUs for long runs, never on CPU)
    activation_checkpointing: bool = False  # recompute each layer's activations in backward
    distributed: str = "ddp"  # under torchrun: "ddp" or "fsdp" (FSDP2 fully_shard per layer)
    collective_timeout: float = 300.0  # under torchrun: seconds a rank waits for the others before
    # failing with a line naming the rank that died or hangs (meshlm.train.watchdog); raise it if
    # one checkpoint takes longer

    def __post_init__(self) -> None:
        if isinstance(self.compile, bool) or str(self.compile).lower() in ("true", "false"):
            self.compile = str(self.compile).lower()  # YAML booleans
        self.validate()

    # -- derived (pure: from these fields alone; meshlm.train.plan adds what needs files) ---------
    def derive_model(self, saved: dict[str, Any] | None = None) -> ModelConfig:
        """The model: the preset + overrides, or `saved` (init_from's model config, read by
        meshlm.train.plan) + overrides; max_loops = the train.loops horizon when sampling
        (train/depth.py: its 95th percentile, at least K). A ConfigError names what is wrong."""
        overrides = dict(self.model)
        preset = overrides.pop("preset", None)
        if saved is not None:
            if preset not in (None, DEFAULT_PRESET):
                raise ConfigError(f"train.init_from takes the architecture from {self.init_from}; "
                                  f"drop model.preset={preset} (use `meshlm retrofit` to change a "
                                  f"checkpoint's layout)")
            cfg = ModelConfig.from_dict({**saved, **overrides})
        elif preset is None:
            cfg = ModelConfig.from_dict(overrides)
        else:
            cfg = ModelConfig.from_preset(preset, **overrides)
        return self._with_loop_cap(cfg, explicit="max_loops" in overrides)

    def loop_distribution(self) -> LoopDistribution:
        return parse_loops(self.loops)

    def _with_loop_cap(self, cfg: ModelConfig, explicit: bool) -> ModelConfig:
        dist = self.loop_distribution()
        k = cfg.layout.n_steps
        if dist.cap(k) != k and len(cfg.layout.cores) != 1:
            raise ConfigError(f"train.loops={self.loops!r} needs a single-core spec (one core run "
                              f"K times, e.g. \"2+2R2+2\"), not {cfg.spec!r}; use "
                              f"train.loops=fixed")
        if explicit or cfg.max_loops is not None:
            return cfg
        horizon = dist.horizon(k)
        return cfg if horizon <= k else cfg.replace(max_loops=horizon)

    def fit_problems(self, model_cfg: ModelConfig) -> list[str]:
        """What of these settings does not fit the model: sequence length, truncated backprop."""
        out = []
        if self.seq_len > model_cfg.context_length:
            out.append(f"seq_len={self.seq_len} exceeds the model's context_length="
                       f"{model_cfg.context_length}; lower train.seq_len or raise "
                       f"model.context_length")
        cap = self.loop_distribution().cap(model_cfg.layout.n_steps)
        if isinstance(self.backprop_loops, int) and self.backprop_loops > cap:
            out.append(f"backprop_loops={self.backprop_loops} is above the largest loop count "
                       f"{cap} that train.loops={self.loops!r} runs; use 0 (all) or 1 … {cap}")
        return out

    def tracker_names(self) -> list[str]:
        """train.loggers as names, without tensorboard when train.tensorboard is false."""
        names = parse_loggers(self.loggers)
        return [n for n in names if self.tensorboard or n != "tensorboard"]

    def sequence_length(self, model_cfg: ModelConfig) -> int:
        return self.seq_len or model_cfg.context_length

    def total_steps(self, model_cfg: ModelConfig) -> int:
        if self.steps:
            return self.steps
        tokens_per_step = self.global_batch * self.sequence_length(model_cfg)
        return max(1, math.ceil(self.tokens / tokens_per_step))

    # -- validation (values only: no file is read; init_from's model is checked by the plan) ------
    def validate(self) -> None:
        """Every problem at once: wrong types first, then values (checked with defaults for mistyped
        fields)."""
        problems, wrong_type = type_problems(self)
        problems += with_defaults(self, wrong_type)._value_problems()
        if problems:
            raise ConfigError(PREFIX + "; ".join(problems))

    def _value_problems(self) -> list[str]:
        problems: list[str] = []

        def need(ok: bool, message: str) -> None:
            if not ok:
                problems.append(message)

        for name in ("global_batch", "micro_batch", "eval_windows", "keep_last", "log_every",
                     "max_nonfinite"):
            need(getattr(self, name) >= 1, f"{name}={getattr(self, name)} must be >= 1")
        for name in ("seq_len", "steps", "tokens", "eval_every", "save_every", "seed"):
            need(getattr(self, name) >= 0, f"{name}={getattr(self, name)} must be >= 0")
        need(self.steps > 0 or self.tokens > 0, "set steps or tokens (both are 0)")
        unknown = [n for n in parse_loggers(self.loggers) if n not in LOGGERS]
        need(not unknown, f"loggers={self.loggers!r}: {unknown} unknown"
                          f"{did_you_mean(unknown, LOGGERS)}; choose from {', '.join(LOGGERS)} "
                          f"(comma-separated) or none")
        one_folder = self.name not in (".", "..") and not set(self.name) & {"/", "\\", "\0"}
        need(not self.name or one_folder,
             f"name={self.name!r} must be one folder name (no '/', not '.' or '..'): the run goes "
             f"to <out_dir>/<name>; put the parent folder in out_dir")
        problems.extend(depth := self._depth_problems())
        problems.extend(self._lora_problems())
        problems.extend(self._optimizer_problems())
        problems.extend(self._run_problems())
        need(isinstance(self.model, dict),
             "model must be a mapping: a preset plus ModelConfig overrides")
        loops_parse = not depth or depth[0].startswith("backprop_loops")
        if isinstance(self.model, dict) and loops_parse and not self.init_from:
            try:  # without init_from the model is data too: checked here, with every other problem
                problems.extend(self.fit_problems(self.derive_model()))
            except ConfigError as err:
                problems.append(str(err))
        return problems

    def _optimizer_problems(self) -> list[str]:
        checks = [
            (self.lr > 0, f"lr={self.lr} must be > 0"),
            (0 <= self.min_lr_ratio <= 1, f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]"),
            (0 <= self.warmup < 1,
             f"warmup={self.warmup} is a fraction of the steps; it must be in [0, 1)"),
            (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
             f"betas={self.betas} must be two numbers in [0, 1)"),
            (self.eps > 0, f"eps={self.eps} must be > 0"),
            (self.weight_decay >= 0, f"weight_decay={self.weight_decay} must be >= 0"),
            (self.grad_clip >= 0,
             f"grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)"),
        ]
        return [message for ok, message in checks if not ok]

    def _run_problems(self) -> list[str]:
        checks = [
            (self.peak_flops >= 0, f"peak_flops={self.peak_flops} must be >= 0 (0 = measure)"),
            (self.collective_timeout > 0,
             f"collective_timeout={self.collective_timeout} must be > 0 (seconds)"),
            (self.device in ("auto", "cpu", "cuda"),
             f"device={self.device!r} must be auto, cpu or cuda"),
            (self.dtype in DTYPES, f"dtype={self.dtype!r} must be one of {', '.join(DTYPES)}"),
            (self.compile in COMPILE,
             f"compile={self.compile!r} must be one of {', '.join(COMPILE)}"),
            (self.distributed in DISTRIBUTED,
             f"distributed={self.distributed!r} must be ddp or fsdp"),
            (self.micro_batch < 1 or self.global_batch % self.micro_batch == 0,
             f"global_batch={self.global_batch} must be a multiple of micro_batch="
             f"{self.micro_batch}"),
        ]
        return [message for ok, message in checks if not ok]

    def _lora_problems(self) -> list[str]:
        out = []
        if self.lora_rank < 0:
            out.append(f"lora_rank={self.lora_rank} must be >= 1 for LoRA (or 0 for none)")
        if self.lora_alpha < 0:
            out.append(f"lora_alpha={self.lora_alpha} must be > 0 (or 0: 2 · rank)")
        if not 0 <= self.lora_dropout < 1:
            out.append(f"lora_dropout={self.lora_dropout} must be in [0, 1)")
        if self.lora_rank > 0 and not self.lora_targets.strip(", "):
            out.append("lora_targets is empty; name roles (attention, mlp, core, ...) or Linear "
                       "names")
        try:
            trainable_roles(self.trainable, None)
        except ConfigError as err:
            out.append(str(err))
        return out

    def _depth_problems(self) -> list[str]:
        """train.loops parses, and backprop_loops is an integer >= 0 (its cap: fit_problems)."""
        try:
            self.loop_distribution()
        except ConfigError as err:
            return [str(err)]
        k = self.backprop_loops
        if not (isinstance(k, int) and k >= 0):
            return [f"backprop_loops={k!r} must be an integer >= 0 (0 = backprop through every "
                    f"loop)"]
        if not (isinstance(self.curriculum, int) and self.curriculum >= 0):
            return [f"curriculum={self.curriculum!r} must be an integer >= 0 (steps per opened "
                    "difficulty; 0 = none)"]
        if not (isinstance(self.reveal, int) and self.reveal >= 0):
            return [f"reveal={self.reveal!r} must be an integer >= 0 (the most loop steps a "
                    "sequence's given values stay hidden; 0 = none)"]
        if self.unlabelled not in UNLABELLED:
            return [f"unlabelled={self.unlabelled!r} must be one of {', '.join(UNLABELLED)} (what "
                    "a labelled task's positions without a label learn)"]
        return []

    # -- serialisation ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_file_dict(self) -> dict[str, Any]:
        """The two-section layout of a config file."""
        data = self.to_dict()
        return {"model": data.pop("model"), "train": data}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build from flat TrainConfig fields, coercing types (meshlm.fields) and collecting every
        problem."""
        data = dict(data)
        for key in ("name", "init_from", "trainable"):
            if key in data and data[key] is None:  # `name=` / `init_from:` (YAML null): unset
                data[key] = ""
        if isinstance(data.get("compile"), bool):  # YAML true/false for "auto"/"true"/"false"
            data["compile"] = str(data["compile"]).lower()
        renamed = data.pop("eval_batches", None) is not None
        values, problems = coerce_all(cls, data, "train")
        if renamed:
            problems.append("eval_batches was replaced by eval_windows (validation windows per "
                            "pass, fixed whatever micro_batch is): set eval_windows = old "
                            "eval_batches × micro_batch")
        return build(cls, values, problems, PREFIX)

    @classmethod
    def from_file_dict(cls, data: dict[str, Any], overrides: list[str] = ()) -> TrainConfig:
        data = data or {}
        unknown = sorted(set(data) - {"model", "train"})
        if unknown:
            raise ConfigError(f"config sections {unknown} are unknown; a config file has `model:` "
                              f"and `train:`")
        for section in ("model", "train"):
            if data.get(section) is not None and not isinstance(data[section], dict):
                raise ConfigError(f"the `{section}:` section must be a mapping of fields, not "
                                  f"{type(data[section]).__name__} {data[section]!r}")
        flat = dict(data.get("train") or {})
        if data.get("model") is not None:
            flat["model"] = dict(data["model"])
        for item in overrides:
            apply_override(flat, item, DEFAULT_PRESET)
        return cls.from_dict(flat)


def find_config(name: str | Path, what: str = "config file") -> Path:
    """A config or study file: `name` if it exists as given, else the shipped file it names
    relative to meshlm/configs, with or without a leading "configs/" and ".yaml":
    "cpu/small-anchor.yaml", "configs/cpu/small-anchor.yaml", "cpu/small-anchor" and
    "studies/quick" all work from any directory."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    rel = Path(*path.parts[1:]) if len(path.parts) > 1 and path.parts[0] == "configs" else path
    for candidate in (SHIPPED_CONFIGS / rel, SHIPPED_CONFIGS / f"{rel}.yaml"):
        if not path.is_absolute() and candidate.is_file():
            return candidate
    raise ConfigError(f"{what} {name} does not exist, here or among the shipped configs; pass a "
                      f"YAML file or a shipped name such as cpu/small-mesh.yaml or "
                      f"studies/quick.yaml (see {SHIPPED_CONFIGS})")


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Read a YAML (or JSON) config file (a path, or a shipped name: find_config), apply dotted
    overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        path = find_config(path)
        data = load_yaml(path) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path} must hold a mapping with `model:` and `train:` sections")
    return TrainConfig.from_file_dict(data, list(overrides))


def dumps(cfg: TrainConfig) -> str:
    return json.dumps(cfg.to_dict(), indent=2, sort_keys=True)
