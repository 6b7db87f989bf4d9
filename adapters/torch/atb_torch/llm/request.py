"""Moved to the core, shared by every front-end: :mod:`atbcore.serving.request`."""

from atbcore.serving.request import *  # noqa: F401,F403
from atbcore.serving.request import __all__  # noqa: F401
