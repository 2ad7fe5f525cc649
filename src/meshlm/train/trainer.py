"""The training loop: gradient accumulation, the paper's optimizer and schedule, validation,
checkpoints.

One optimizer step s (0-based) consumes the global batch `get_batch(step=s)`; a checkpoint named
step-N holds the state after N steps, so resuming from it replays step N next with exactly the data,
learning rate, optimizer state and RNG the uninterrupted run had: on CPU the resumed run is
bit-identical.

A step whose loss or gradient norm is non-finite is skipped (gradients dropped, weights untouched,
the step counter and schedule still advance); `max_nonfinite` such steps in a row abort the run.
Since skipped steps never touch the weights, no checkpoint can hold a non-finite state (and save
refuses one).
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from meshlm import checkpoint
from meshlm.adapters import adapt
from meshlm.backbones import BACKBONES
from meshlm.data.order import validation_batches
from meshlm.data.tasks import curriculum, unlabelled
from meshlm.errors import ConfigError, MeshlmError
from meshlm.folders import integrity
from meshlm.model import MeshLM
from meshlm.model.accounting import describe, train_flops_per_token
from meshlm.runtime import allocator
from meshlm.runtime.peaks import device_peak
from meshlm.train import parallel
from meshlm.train.batches import get_batch, windows_xy
from meshlm.train.checkpointing import Checkpointing
from meshlm.train.config import TrainConfig
from meshlm.train.data_source import open_data, prepared_dir
from meshlm.train.interrupt import StopRequest
from meshlm.train.monitor import Metrics, Progress
from meshlm.train.optim import build_optimizer, build_scheduler
from meshlm.train.ownership import RunOwner
from meshlm.train.plan import RunPlan, resolve
from meshlm.train.preflight import preflight, schedule_warnings
from meshlm.train.reveal import RevealDraws
from meshlm.train.watchdog import RankWatch


class NonFiniteLossError(MeshlmError):
    """Too many non-finite steps in a row: the run diverged."""


@dataclass
class TrainResult:
    run_dir: Path
    steps: int  # optimizer steps completed (including any before a resume)
    start_step: int  # where this process started (0, or the resumed checkpoint's step)
    losses: dict[int, float] = field(default_factory=dict)  # step -> train loss, this process's
    # steps
    val_loss: float = math.nan
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    wall_s: float = 0.0
    checkpoint: Path | None = None
    data_dir: Path | None = None

    @property
    def val_ppl(self) -> float:
        return math.exp(self.val_loss) if math.isfinite(self.val_loss) else math.nan


# with MoE layers, logged next to the loss they make up
LOSS_PARTS = ("lm_loss", "aux_loss", "z_loss")


class Trainer(Checkpointing):
    """One training run of a resolved plan (meshlm.train.plan) on the devices of `env`; saving,
    resuming and init_from come from meshlm.train.checkpointing."""

    def __init__(self, plan: RunPlan, env: parallel.Env, resume: bool = False,
                 log: Callable[[str], None] = print):
        cfg = plan.cfg
        self.plan, self.cfg, self.env, self.model_cfg = plan, cfg, env, plan.model
        self.log = log if env.is_main else (lambda message: None)
        self.total_steps, self.run_dir = plan.total_steps, plan.run_dir
        if cfg.global_batch % (env.world * cfg.micro_batch):
            raise ConfigError(f"global_batch={cfg.global_batch} must be a multiple of world size "
                              f"{env.world} × micro_batch={cfg.micro_batch}; change "
                              f"train.global_batch or train.micro_batch")
        self.accum = cfg.global_batch // (env.world * cfg.micro_batch)  # micro-batches per rank
        self.data_dir = prepared_dir(plan, env)
        data = open_data(plan, self.data_dir)  # the checks preflight ran, on the folder opened
        self.train_data, self.val_data, self.seq_len = data.train, data.val, data.seq_len
        # a curriculum: step -> the windows of the difficulties opened by then (None: all)
        self.opened = (curriculum(self.train_data.manifest, cfg.curriculum, self.seq_len)
                       if cfg.curriculum else None)
        self.train_data.unlabelled = unlabelled(self.train_data, cfg.unlabelled)
        self._build_model(resume)
        # train.reveal (checked by preflight): the given values' hidden steps, drawn per step
        self.reveal = RevealDraws(self.train_data, cfg.reveal, cfg.seed) if cfg.reveal else None
        self.optimizer = build_optimizer(self.model, cfg, env.device)
        self.scheduler = build_scheduler(self.optimizer, cfg, self.total_steps)
        self.flops_per_token = describe(self.model_cfg, self.seq_len).train_flops_per_token
        # the spec's K; with a varying depth: the mean over the steps run of their drawn depth
        self.flops_seen, self.steps_seen, self._flops_at = 0.0, 0, {}
        self.peak, self.peak_source = device_peak(env.device, env.autocast_dtype, cfg.peak_flops)
        self.metrics = Metrics(self.run_dir, enabled=env.is_main, loggers=cfg.tracker_names(),
                               name=self.run_dir.name)
        self.step, self.best_val, self.nonfinite_in_row = 0, math.inf, 0
        self.loss_parts: dict[str, float] = {}  # the last step's lm/aux/z losses (MoE only)
        self._prepare_run_dir(resume)

    def _build_model(self, resume: bool) -> None:
        """The model, its init_from weights, adapters and trainable set, then its wrapping."""
        torch.manual_seed(self.cfg.seed)  # same initial weights on every rank and every resume
        self.model = MeshLM(self.model_cfg).to(self.env.device)  # the unwrapped handle: saving
        resuming = resume and integrity.list_checkpoints(self.run_dir)
        if self.plan.init is not None and not resuming:
            self._initialise_from(self.plan.init)  # before LoRA renames the Linears it wraps
        self.trainable = adapt(self.model, self.cfg.to_dict())  # LoRA, frozen set (meshlm.adapters)
        self.wrapped = parallel.wrap(self.model, self.plan, self.env)  # what forward() goes through
        self.loop_dist = self.plan.loops  # loop count per step from (seed, step): same on all ranks
        self.step_loops = self.model_cfg.layout.n_steps  # the last step's count (logged if sampled)

    # -- one optimizer step ------------------------------------------------------------------------
    def train_step(self, step: int) -> tuple[float, float, bool]:
        """Forward/backward over this rank's micro-batches, then clip and step. Returns (loss, grad
        norm, ok)."""
        cfg, env = self.cfg, self.env
        batches = get_batch(self.train_data, step, cfg.global_batch, self.seq_len, cfg.seed,
                            env.rank, env.world, micro_batches=self.accum,
                            n_sequences=self.opened(step) if self.opened else None)
        total = torch.zeros((), device=env.device)
        parts = {name: torch.zeros((), device=env.device) for name in LOSS_PARTS}
        depth = {}  # fixed depth: the model's own K, exactly today's call
        if self.plan.varies_depth:
            depth = dict(loops=self.loop_dist.draw(cfg.seed, step),
                         backprop_loops=cfg.backprop_loops or None)
        self.step_loops = depth.get("loops") or self.model_cfg.layout.n_steps
        hidden = (self.reveal.steps(step, cfg.global_batch, env.rank, env.world, len(batches))
                  if self.reveal else None)
        for i, (x, y) in enumerate(batches):  # x, y: (micro_batch, seq_len)
            x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
            reveal = {"reveal": self.reveal.reveal(x, hidden[i])} if hidden else {}
            with parallel.no_sync(self.wrapped, sync=i == len(batches) - 1):
                with parallel.autocast(env):
                    out = self.wrapped(x, y, **depth, **reveal)
                # mean over micro-batches = mean over the global batch
                (out.loss / len(batches)).backward()
            total += out.loss.detach()
            for name in parts:
                if getattr(out, name) is not None:
                    parts[name] += getattr(out, name).detach().float()
        loss = parallel.all_mean(total / len(batches), env)
        self.loss_parts = ({name: parallel.all_mean(value / len(batches), env).item()
                            for name, value in parts.items()}
                           if BACKBONES[self.model_cfg.backbone].moe else {})
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip or math.inf)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        # identical on every rank (reduced values)
        ok = bool(torch.isfinite(loss) & torch.isfinite(norm))
        if ok:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss.item(), norm.item(), ok

    # -- validation --------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean next-token loss over a fixed set of `eval_windows` validation windows spread evenly
        over the split: the same set, so the same number, for any micro_batch and world size."""
        cfg, env = self.cfg, self.env
        batches = validation_batches(self.val_data.num_sequences(self.seq_len), cfg.eval_windows,
                                     cfg.micro_batch, env.rank, env.world)
        total = torch.zeros((), device=env.device, dtype=torch.float64)
        count = torch.zeros((), device=env.device, dtype=torch.float64)
        self.model.eval()
        for indices, counted in batches:
            # (b, seq_len)
            x, y = (t.to(env.device) for t in windows_xy(self.val_data, indices, self.seq_len))
            with parallel.autocast(env):
                loss = self.wrapped(x, y).loss
            if counted:  # a padding forward only keeps the ranks in step
                scored = (y != -100).sum()  # every target, or task data's answer tokens
                total += loss.double() * scored
                count += scored
        self.model.train()
        return (parallel.all_sum(total, env) / parallel.all_sum(count, env)).item()

    # -- the loop ----------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        result = TrainResult(self.run_dir, self.step, self.step, data_dir=self.data_dir)
        self._announce()
        bar = Progress(self.env.is_main and self.cfg.progress, self.env.is_main, self.total_steps,
                       self.step,
                       self.run_dir.name)
        start, train_time, rate = time.perf_counter(), 0.0, 0.0
        if self.step >= self.total_steps:  # resumed a finished run: report it, train nothing
            result.val_loss, result.checkpoint = self.evaluate(), integrity.resolve(self.run_dir)
        # a rank that dies or hangs is named
        watch = RankWatch(self.env, self.cfg.collective_timeout)
        try:
            # handlers stay while it looks
            with StopRequest(self.log) as stop, watch, watch.naming_failures(stop):
                while self.step < self.total_steps:
                    watch.beat(self.step)
                    if stop.requested(self.env):
                        raise self._stop(stop, result)
                    # the rate this step uses
                    t0, lr = time.perf_counter(), self.scheduler.get_last_lr()[0]
                    loss, norm, ok = self.train_step(self.step)
                    dt = time.perf_counter() - t0
                    self.step += 1
                    self._count_flops()
                    train_time += dt
                    rate = (self.tokens_per_step / dt if rate == 0
                            else 0.9 * rate + 0.1 * self.tokens_per_step / dt)
                    self._after_step(ok, loss, norm, bar)
                    self._record(ok, loss, norm, lr, rate, time.perf_counter() - start, bar)
                    result.losses[self.step] = loss
                    self._evaluate_and_save(loss, result, bar)
        finally:
            bar.close()
            self.metrics.close()
        result.steps, result.wall_s = self.step, time.perf_counter() - start
        result.tokens_per_s = (self.step
                               - result.start_step) * self.tokens_per_step / max(train_time, 1e-9)
        result.mfu = self.mfu(result.tokens_per_s)
        return result

    def _stop(self, stop: StopRequest, result: TrainResult) -> Exception:
        """Save the current step (unless just saved; no validation pass, to stop quickly) -> the
        error to raise."""
        saved = (result.checkpoint is not None
                 and checkpoint.step_dir_name(self.step) == result.checkpoint.name)
        if self.step > result.start_step and not saved:
            result.checkpoint = self.save(math.nan)
        where = (f"checkpoint {result.checkpoint} holds step {self.step}/{self.total_steps}"
                 if result.checkpoint is not None
                 else f"nothing to save at step {self.step}/{self.total_steps}")
        return stop.error(f"{where}; resume with the same command and --resume")

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.global_batch * self.seq_len

    def _count_flops(self) -> None:
        """The mean training FLOPs per token over the steps run, each at the loop count it drew."""
        cfg = self.cfg
        if not self.plan.varies_depth:
            return  # the spec's K every step: describe's figure
        loops = self.step_loops
        if loops not in self._flops_at:
            self._flops_at[loops] = train_flops_per_token(self.model, loops,
                                                          cfg.backprop_loops or None, self.seq_len)
        self.flops_seen, self.steps_seen = (self.flops_seen + self._flops_at[loops],
                                            self.steps_seen + 1)
        self.flops_per_token = self.flops_seen / self.steps_seen

    def mfu(self, tokens_per_s: float) -> float:
        return tokens_per_s * self.flops_per_token / (self.peak * self.env.world)

    def _announce(self) -> None:
        """The run's first line and first metrics record: what runs, in which precision, compiled or
        not, and the peak MFU divides by (each with the reason it was chosen)."""
        m, cfg, env = self.model_cfg, self.cfg, self.env
        self.log(f"training {self.run_dir.name}: {m.spec} {m.scheme} d={m.d_model}, "
                 f"{self.total_steps} steps x {cfg.global_batch} x {self.seq_len} tokens, world "
                 f"{env.world}, {env.device.type} {env.precision.describe()}, "
                 f"{env.compile.describe()}; MFU peak {self.peak / 1e9:,.0f} GFLOP/s per device "
                 f"({self.peak_source}); {self._trainable_text()}")
        run = {"device": env.device.type, "world": env.world, "threads": torch.get_num_threads(),
               "dtype": env.precision.name, "dtype_reason": env.precision.reason,
               "compile": env.compile.enabled,
               "compile_reason": env.compile.reason, "peak_flops": self.peak,
               "peak_source": self.peak_source,
               "malloc": allocator.tune(), "trainable_params": self.trainable,
               "total_params": sum(p.numel() for p in self.model.parameters())}
        self.metrics.log({"kind": "run", "step": self.step, **run})
        # the model: resolved, beside
        train = {k: v for k, v in cfg.to_dict().items() if k != "model"}
        self.metrics.hparams({"train": train, "model": m.to_dict(), "run": run})

    def _trainable_text(self) -> str:
        total = sum(p.numel() for p in self.model.parameters())
        return (f"training {self.trainable:,} of {total:,} parameters "
                f"({100 * self.trainable / total:.2f}%)")

    def _record(self, ok: bool, loss: float, norm: float, lr: float, rate: float, elapsed: float,
                bar: Progress) -> None:
        if self.step % self.cfg.log_every == 0 or not ok:
            self.metrics.log({"kind": "train" if ok else "skip", "step": self.step, "loss": loss,
                              "lr": lr,
                              "grad_norm": norm, "tokens": self.step * self.tokens_per_step,
                              "tokens_per_s": rate, "mfu": self.mfu(rate), "elapsed_s": elapsed,
                              **self.loss_parts,
                              **({"loops": self.step_loops} if self.loop_dist.sampled else {})})
        bar.update(loss, rate, self.mfu(rate), lr)

    def _evaluate_and_save(self, loss: float, result: TrainResult, bar: Progress) -> None:
        """Validate every eval_every steps; save every save_every steps (validating first); both at
        the end."""
        cfg, last = self.cfg, self.step == self.total_steps
        saving = last or (cfg.save_every > 0 and self.step % cfg.save_every == 0)
        if saving or (cfg.eval_every > 0 and self.step % cfg.eval_every == 0):
            result.val_loss = self.evaluate()
            ppl = math.exp(min(result.val_loss, 700))
            self.metrics.log({"kind": "eval", "step": self.step, "val_loss": result.val_loss,
                              "val_ppl": ppl,
                              "tokens": self.step * self.tokens_per_step})
            bar.write(f"step {self.step}/{self.total_steps}: train loss {loss:.4f}, val loss "
                      f"{result.val_loss:.4f}, val ppl {ppl:.2f}")
        if saving:
            result.checkpoint = self.save(result.val_loss)

    def _after_step(self, ok: bool, loss: float, norm: float, bar: Progress) -> None:
        if ok:
            self.nonfinite_in_row = 0
            return
        self.nonfinite_in_row += 1
        bar.write(f"warning: step {self.step}: non-finite loss {loss} / grad norm {norm}; step "
                  f"skipped ({self.nonfinite_in_row} in a row, abort at {self.cfg.max_nonfinite})")
        if self.nonfinite_in_row >= self.cfg.max_nonfinite:
            raise NonFiniteLossError(
                f"loss or gradients were non-finite for {self.nonfinite_in_row} steps in a row "
                f"(last at step {self.step}); the run diverged: lower train.lr or raise "
                f"train.warmup, then --resume from the last checkpoint in {self.run_dir}")


def train(run: TrainConfig | RunPlan, resume: bool = False,
          log: Callable[[str], None] = print) -> TrainResult:
    """Tune malloc (if `meshlm train` has not yet), resolve the run (once: meshlm.train.plan), check
    every input, set up devices (and the process group under torchrun), take ownership of the run
    folder (meshlm.train.ownership), train, tear down."""
    allocator.tune()
    plan = run if isinstance(run, RunPlan) else resolve(run)
    preflight(plan, resume)
    env = parallel.setup(plan)
    if env.is_main:
        for warning in schedule_warnings(plan.cfg, plan.total_steps, plan.seq_len):
            log(f"warning: {warning}")
    try:  # rank 0 owns the folder
        with RunOwner(plan.run_dir, log) if env.is_main else contextlib.nullcontext():
            return Trainer(plan, env, resume=resume, log=log).run()
    finally:
        parallel.teardown()
