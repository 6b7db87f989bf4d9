"""Moved to the core, shared by every front-end: :mod:`atbcore.serving.outputs`."""

from atbcore.serving.outputs import *  # noqa: F401,F403
from atbcore.serving.outputs import __all__  # noqa: F401
