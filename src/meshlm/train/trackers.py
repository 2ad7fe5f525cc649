"""Experiment trackers beside metrics.jsonl, chosen by `train.loggers` (comma-separated):

    tensorboard  <run>/tensorboard/    settings in the HParams tab, metrics as scalars
    wandb        Weights & Biases run  settings as its config; WANDB_MODE=offline works without a
                                       network
    mlflow       MLflow run            settings as params; MLFLOW_TRACKING_URI (e.g. a server or
                                       sqlite:///mlflow.db), else a file store in <run>/mlruns
                                       (MLFLOW_EXPERIMENT_NAME, else "meshlm")
    csv          <run>/csv/<kind>.csv  one file per record kind (train, eval, skip), settings in
                                       <run>/csv/hparams.csv

Each tracker gets the run's settings once (`hparams`: the train config, the model config and how the
run runs, flattened to "train.lr", "model.d_model", "run.dtype" ...) and every numeric field of each
train/eval/skip record as a metric at its step. The packages are optional imports: `missing` names
the install command of each asked-for package that is absent (training checks it before it starts);
only the default TensorBoard, when absent, is a warning and not an error.
"""
from __future__ import annotations

import csv
import hashlib
import importlib.util
import json
import math
import os
import threading
from pathlib import Path
from typing import Any

from meshlm import atomic

LOGGERS = ("tensorboard", "wandb", "mlflow", "csv")
# tracker -> its import
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
# -> its pip name
INSTALL = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny"}


def parse_loggers(text: str) -> list[str]:
    """"tensorboard,wandb" -> the names; "" or "none" -> []."""
    return ([] if text.strip().lower() in ("", "none")
            else [n.strip() for n in text.split(",") if n.strip()])


def missing(loggers: list[str]) -> list[str]:
    """One message per asked-for tracker whose package is not installed."""
    return [f"train.loggers has {name} but the {PACKAGES[name]} package is not installed; pip "
            f"install -c constraints.txt {INSTALL[name]}, or drop {name} from train.loggers"
            for name in loggers if name in PACKAGES
            and importlib.util.find_spec(PACKAGES[name]) is None]


def flatten(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"model": {"d_model": 64}} -> {"model.d_model": 64}; lists and None become strings (what
    trackers take)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value if isinstance(value, (bool, int, float, str)) else json.dumps(value)
    return out


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a record, named "<kind>/<field>"."""
    kind = record.get("kind", "train")
    return {f"{kind}/{k}": float(v) for k, v in record.items() if k not in ("kind", "step")
            and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def quiet_tensorboard_thread() -> None:
    """TensorBoard writes events from a thread that, on a failed write, prints its traceback before
    the main thread sees the error: silence that thread's filesystem errors (Metrics reports them as
    one line)."""
    previous = threading.excepthook
    if getattr(previous, "meshlm_quiet", False):
        return

    def hook(args) -> None:
        if not (type(args.thread).__name__ == "_AsyncWriterThread"
                and issubclass(args.exc_type, OSError)):
            previous(args)
    hook.meshlm_quiet = True
    threading.excepthook = hook


# Every tracker names the `subfolder` of the run it writes to and `what` it writes there, for
# Metrics' one-line storage error.
class TensorBoard:
    what, subfolder = "TensorBoard events", "tensorboard"

    def __init__(self, run_dir: Path, name: str):
        from torch.utils.tensorboard import SummaryWriter

        quiet_tensorboard_thread()
        self.writer = SummaryWriter(str(run_dir / self.subfolder))

    def hparams(self, params: dict[str, Any]) -> None:
        """Into the same event file as the scalars, so the HParams tab links them (not add_hparams,
        which writes a separate sub-run)."""
        from torch.utils.tensorboard.summary import hparams

        # names only: declared columns
        metrics = {"eval/val_loss": 0.0, "eval/val_ppl": 0.0, "train/loss": 0.0}
        for summary in hparams(params, metrics):
            self.writer.file_writer.add_summary(summary)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class Wandb:
    what, subfolder = "W&B files", "wandb"

    def __init__(self, run_dir: Path, name: str):
        import wandb

        # one id per run folder, so --resume continues the same W&B run
        run_id = f"{name}-{hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]}"
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "meshlm"), name=name,
                              id=run_id,
                              dir=str(run_dir), resume="allow", reinit="finish_previous")

    def hparams(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class Mlflow:
    what, subfolder = "MLflow records", "mlruns"

    def __init__(self, run_dir: Path, name: str):
        import mlflow

        self.mlflow = mlflow
        # the local default: a file store beside the run
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # MLflow 3 keeps it, in maintenance mode
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((run_dir / self.subfolder).resolve().as_uri())
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "meshlm"))
        self.run = mlflow.start_run(run_name=name)

    def hparams(self, params: dict[str, Any]) -> None:
        # MLflow's limit per value
        self.mlflow.log_params({k: str(v)[:6000] for k, v in params.items()})

    def log(self, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class Csv:
    """<run>/csv/<kind>.csv with a header from the kind's first record (later fields beyond it are
    dropped)."""

    what, subfolder = "CSV metrics", "csv"

    def __init__(self, run_dir: Path, name: str):
        self.dir = run_dir / self.subfolder
        self.dir.mkdir(parents=True, exist_ok=True)

    def hparams(self, params: dict[str, Any]) -> None:
        with open(self.dir / "hparams.csv", "w", newline="") as f:
            csv.writer(f).writerows([("name", "value"), *params.items()])

    def log(self, step: int, values: dict[str, float]) -> None:
        by_kind: dict[str, dict[str, float]] = {}
        for key, value in values.items():
            kind, _, field = key.partition("/")
            by_kind.setdefault(kind, {})[field] = value
        for kind, row in by_kind.items():
            path = self.dir / f"{kind}.csv"
            fresh = not path.exists()
            header = ["step", *row] if fresh else _rows(path)[0]
            with open(path, "a", newline="") as f:
                writer = csv.DictWriter(f, header, extrasaction="ignore")
                if fresh:
                    writer.writeheader()
                writer.writerow({"step": step, **row})

    def truncate_after(self, step: int) -> None:
        """On resume: drop rows from steps after the checkpoint (as metrics.jsonl)."""
        for path in self.dir.glob("*.csv"):
            if path.name == "hparams.csv":
                continue
            rows = _rows(path)
            kept = rows[:1] + [r for r in rows[1:] if r and int(float(r[0])) <= step]
            atomic.write_with(path, lambda tmp, kept=kept: _write_rows(tmp, kept))

    def close(self) -> None:
        pass


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def _write_rows(path: Path, rows: list[list[str]]) -> None:
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)


TRACKERS = {"tensorboard": TensorBoard, "wandb": Wandb, "mlflow": Mlflow, "csv": Csv}
