"""The ``atb`` logger. ``ATB_LOG_LEVEL`` (DEBUG/INFO/WARNING/ERROR) sets its level."""

from __future__ import annotations

import logging
import os

__all__ = ["logger", "set_log_level"]

logger = logging.getLogger("atb")


def set_log_level(level: str | int) -> None:
    """Set the level of the ``atb`` logger and make sure its records are shown."""
    if isinstance(level, str):
        level = level.upper()
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[ATB] %(levelname)s: %(message)s"))
        logger.addHandler(handler)


if os.environ.get("ATB_LOG_LEVEL"):
    set_log_level(os.environ["ATB_LOG_LEVEL"])
else:
    # WARNING unless asked: a framework that sets the root logger to INFO (Paddle does
    # at import) must not turn atb's per-kernel INFO lines on for its users
    logger.setLevel(logging.WARNING)
