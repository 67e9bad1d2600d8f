"""Ingero: eBPF tracing of distributed training (NCCL, TCP, scheduler) per rank."""

from importlib.metadata import PackageNotFoundError, version

try:    # pyproject.toml's version, the one version source (scripts/release.py)
    __version__ = version("ingero")
except PackageNotFoundError:     # the sources alone, not installed
    __version__ = "0+unknown"
