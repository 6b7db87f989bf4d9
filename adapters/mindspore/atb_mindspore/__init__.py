"""atb for MindSpore: ``import atb_mindspore as atb`` (re-exports the core API)."""

from atbcore import *  # noqa: F401,F403
from atbcore import __all__ as _core_all
from atbcore import __version__  # noqa: F401

__all__ = list(_core_all)
