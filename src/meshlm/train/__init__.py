"""Training: config, optimizer/schedule, distributed wrapping, monitoring and the loop (see trainer.py)."""
from meshlm.train.config import TrainConfig, load_config
from meshlm.train.trainer import NonFiniteLossError, Trainer, TrainResult, train

__all__ = ["NonFiniteLossError", "TrainConfig", "TrainResult", "Trainer", "load_config", "train"]
