"""atb for PyTorch: ``import atb_torch as atb``.

Re-exports the core API (``Builder``, ``Dtype``, ``TensorDesc``,
``list_operations``, ``AtbError`` ...) so the seed articles' code runs as written.
"""

from atbcore import *  # noqa: F401,F403  (the contract: every front-end re-exports the core)
from atbcore import __all__ as _core_all
from atbcore import __version__  # noqa: F401

__all__ = list(_core_all)
