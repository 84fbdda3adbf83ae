"""The cache format: the only contract between `dflash.extract` and `dflash.train` (spec: FORMAT.md)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dflash")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
