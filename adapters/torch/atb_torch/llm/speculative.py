"""Moved to the core, shared by every front-end: :mod:`atbcore.serving.speculative`."""

from atbcore.serving.speculative import *  # noqa: F401,F403
from atbcore.serving.speculative import __all__  # noqa: F401
