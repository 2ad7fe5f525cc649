"""meshlm: recursive Transformers with MeSH."""
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("meshlm")
except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
    __version__ = "0+unknown"
