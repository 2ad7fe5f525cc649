"""Errors that mean "the user asked for something impossible": the CLI prints them as one line."""


class MeshlmError(Exception):
    """Base class: the message names the problem and the fix."""


class ConfigError(MeshlmError, ValueError):
    """An invalid model or training configuration."""


class DataError(MeshlmError, ValueError):
    """A missing, empty or malformed corpus, tokenizer or prepared dataset."""


class CheckpointError(MeshlmError):
    """A missing, truncated or corrupt checkpoint."""
