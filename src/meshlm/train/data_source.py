"""Where a training run's prepared data come from: the embedded corpus or a reasoning task, each prepared once
into the cache (rank 0 first, the others then find it), or the user's own prepared folder."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from meshlm.data.prepare import prepare_default
from meshlm.data.tasks import cached_task_data, is_task_source
from meshlm.errors import ConfigError
from meshlm.train import parallel
from meshlm.train.config import TrainConfig


def resolve_data(cfg: TrainConfig, env: parallel.Env, tokenizer: str) -> Path:
    """The prepared-data dir: the embedded corpus (prepared once with `tokenizer`, rank 0 first) or the user's
    folder."""
    if cfg.data == "default":
        return _main_rank_first(env, lambda main: prepare_default(tokenizer=tokenizer, progress=main))
    if is_task_source(cfg.data):  # generated once into the cache
        return _main_rank_first(env, lambda main: cached_task_data(cfg.data))
    path = Path(cfg.data).expanduser()
    if not path.is_dir():
        raise ConfigError(f"train.data={cfg.data}: {path} does not exist; run `meshlm prepare` or set "
                          f"train.data=default")
    return path


def _main_rank_first(env: parallel.Env, make: Callable[[bool], Path]) -> Path:
    """Cached data: rank 0 makes it (`make(True)`: with progress) while the others wait, then they find it."""
    path = make(True) if env.is_main else None
    parallel.barrier(env)
    return path or make(False)
