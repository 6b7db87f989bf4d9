"""Moved to the core, shared by every front-end: :mod:`atbcore.serving.detok`."""

from atbcore.serving.detok import *  # noqa: F401,F403
from atbcore.serving.detok import __all__  # noqa: F401
