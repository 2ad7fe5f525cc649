"""train.loggers: TensorBoard, Weights & Biases (offline), MLflow (a local file store) and CSV, each
written for real by a short training run and read back with the tracker's own reader: the settings
as hyperparameters/config/params, the metrics as curves; a missing package is a clear error before
training."""
from __future__ import annotations

import csv
import json
import sys

import pytest
from trainkit import run_dir, tiny_train

from meshlm.errors import ConfigError
from meshlm.train import trackers
from meshlm.train.plan import resolve
from meshlm.train.preflight import preflight
from meshlm.train.trainer import train

STEPS = 4


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, prepared_module):
    out = tmp_path_factory.mktemp("tracked")
    with pytest.MonkeyPatch.context() as patch:
        for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                           "WANDB_DIR": str(out)}.items():
            patch.setenv(key, value)
        patch.delenv("MLFLOW_TRACKING_URI", raising=False)
        cfg = tiny_train(prepared_module, out, steps=STEPS, save_every=0, eval_every=2, lr=2e-3,
                         loggers="tensorboard,wandb,mlflow,csv", tensorboard=True)
        train(cfg)
    return run_dir(cfg), cfg


@pytest.fixture(scope="module")
def prepared_module(tmp_path_factory):
    from trainkit import make_prepared

    return make_prepared(tmp_path_factory)


@pytest.mark.slow  # wandb starts its service process
def test_tensorboard_gets_settings_as_hparams_and_metrics_as_scalars(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    run_dir, cfg = tracked_run
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "eval/val_loss"} <= scalars
    assert not any(tag.startswith("run/") for tag in scalars)  # settings are not curves
    assert len(events.Scalars("train/loss")) == STEPS
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = HParamsPluginData.FromString(content).session_start_info.hparams
    assert (hparams["train.lr"].number_value == cfg.lr
            and hparams["model.d_model"].number_value == 64)
    assert hparams["run.device"].string_value == "cpu"


def wandb_records(path):
    """The protobuf Records of an offline .wandb file: wandb's LevelDB-style log (a 7-byte header,
    then records in 32 KiB blocks, each chunk with a crc32, a length and a full/first/middle/last
    type)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, pending, records = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


@pytest.mark.slow
def test_wandb_offline_run_holds_the_config_and_the_metrics(tracked_run):
    run_dir, cfg = tracked_run
    (log,) = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    records = wandb_records(log)
    config = {u.key: json.loads(u.value_json) for r in records
              if r.HasField("config") for u in r.config.update}
    assert config["train.lr"] == cfg.lr and config["model.spec"] == cfg.derive_model().spec
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.HasField("history")]
    losses = [(h["_step"], h["train/loss"]) for h in history if "train/loss" in h]
    assert ([step for step, _ in losses] == list(range(1, STEPS + 1))
            and all(loss > 0 for _, loss in losses))
    assert [h["_step"] for h in history if "eval/val_loss" in h] == [2, 4]


@pytest.mark.slow
def test_mlflow_file_store_holds_params_and_metric_history(tracked_run):
    from mlflow.tracking import MlflowClient

    run_dir, cfg = tracked_run
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("meshlm").experiment_id])
    assert run.info.run_name == run_dir.name and run.data.params["train.lr"] == str(cfg.lr)
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == list(range(1, STEPS + 1))


@pytest.mark.slow
def test_csv_has_one_file_per_record_kind_and_the_settings(tracked_run):
    run_dir, cfg = tracked_run
    rows = list(csv.DictReader(open(run_dir / "csv" / "train.csv")))
    assert ([int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
            and float(rows[0]["loss"]) > 0)
    assert [int(r["step"]) for r in csv.DictReader(open(run_dir / "csv" / "eval.csv"))] == [2, 4]
    settings = dict(csv.reader(open(run_dir / "csv" / "hparams.csv")))
    assert (settings["train.lr"] == str(cfg.lr)
            and settings["train.loggers"] == "tensorboard,wandb,mlflow,csv")


def test_csv_rows_after_the_checkpoint_go_on_resume(tmp_path):
    tracker = trackers.Csv(tmp_path, "run")
    for step in (1, 2, 3):
        tracker.log(step, {"train/loss": 1.0 / step})
    tracker.truncate_after(2)
    assert [r["step"] for r in csv.DictReader(open(tmp_path / "csv" / "train.csv"))] == ["1", "2"]


def test_an_unknown_logger_or_a_missing_package_is_a_clear_error(tmp_path, monkeypatch):
    from trainkit import make_prepared  # noqa: F401  (the preflight below needs no data: a config error first)

    with pytest.raises(ConfigError,
                       match=r"loggers='tensorbord': \['tensorbord'\] unknown \(did you mean "
                             r"'tensorboard'\?\)"):
        tiny_train(tmp_path, tmp_path, loggers="tensorbord")
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the package were not installed
    monkeypatch.setitem(sys.modules, "mlflow", None)
    cfg = tiny_train("default", tmp_path, loggers="wandb,mlflow,csv")
    with pytest.raises(ConfigError) as err:
        preflight(resolve(cfg))
    assert "train.loggers has wandb but the wandb package is not installed; pip install" in str(
        err.value)
    assert "pip install -c constraints.txt mlflow-skinny" in str(err.value)
    assert (trackers.parse_loggers("none") == []
            and trackers.parse_loggers("csv, wandb") == ["csv", "wandb"])
