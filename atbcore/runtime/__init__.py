"""Runtime configuration (``init``), compatibility checks, and later the executor."""

from .config import check_compatibility, get_config, init

__all__ = ["init", "get_config", "check_compatibility"]
