"""What training reports: periodic progress lines without a terminal, TensorBoard events or a clear
note."""
from __future__ import annotations

import io
import sys

from meshlm.train.monitor import Metrics, Progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_without_a_terminal_progress_is_periodic_lines():
    log = io.StringIO()  # not a TTY, like a log file or a batch job's output
    bar = Progress(True, True, total=200, initial=0, desc="run", stream=log, every_s=1e9)
    for step in range(200):
        bar.update(loss=5.0 - step / 100, tokens_per_s=2900.0, mfu=0.031, lr=1e-3)
    bar.write("step 200/200: val loss 3.0")
    bar.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and max(map(len, lines)) < 200
    progress = [line for line in lines if line.startswith("run: step ")]
    assert (len(progress) == 20
            and progress[0].startswith("run: step 10/200 (5%) | loss 4.910 | 2,900 tok/s"))
    assert (progress[-1].startswith("run: step 200/200 (100%)")
            and "MFU 3.1% | lr 1.00e-03 | elapsed" in progress[-1])
    assert lines[-1] == "step 200/200: val loss 3.0"


def test_a_resumed_run_counts_from_its_step_and_time_also_triggers_a_line():
    log = io.StringIO()
    # every step is due
    bar = Progress(True, True, total=100, initial=90, desc="run", stream=log, every_s=0.0)
    for _ in range(10):
        bar.update(1.0, 1.0, 0.0, 1e-3)
    assert [line.split(" (")[0] for line in log.getvalue().splitlines()] == [f"run: step {s}/100"
                                                                             for s in
                                                                            range(91, 101)]


def test_on_a_terminal_progress_is_a_tqdm_bar():
    term = FakeTerminal()
    bar = Progress(True, True, total=5, initial=0, desc="run", stream=term)
    for _ in range(5):
        bar.update(1.0, 1.0, 0.0, 1e-3)
    bar.close()
    assert bar.bar is not None and "\r" in term.getvalue() and "5/5" in term.getvalue()


def test_tensorboard_events_are_written(tmp_path):
    metrics = Metrics(tmp_path, enabled=True, loggers=["tensorboard"])
    metrics.log({"kind": "train", "step": 1, "loss": 2.5})
    metrics.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_tensorboard_asked_for_but_missing_says_so(tmp_path, monkeypatch, capsys):
    # as if the package were not installed
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    metrics = Metrics(tmp_path, enabled=True, loggers=["tensorboard"])
    metrics.log({"kind": "train", "step": 1, "loss": 2.5})
    assert metrics.tb is None and (tmp_path / "metrics.jsonl").is_file()
    assert "tensorboard package is not installed" in capsys.readouterr().err
