"""Moved to the core, shared by every front-end: :mod:`atbcore.serving.spec_cache`."""

from atbcore.serving.spec_cache import *  # noqa: F401,F403
from atbcore.serving.spec_cache import __all__  # noqa: F401
