"""``import atb``: the PyTorch front-end under the distribution's own name.

The seed articles write ``import atb`` and ``from atb import LLM``; this package is
:mod:`atb_torch` under that name, so both spellings give the same objects::

    import atb
    llm = atb.LLM("./my-llama")            # atb.LLM is atb_torch.LLM
    out = atb.RmsNorm(eps=1e-6)(x)

It needs torch. Without it, ``import atb`` raises an :class:`ImportError` that names
the other front-ends (``import atb_mindspore as atb``, ``import atb_paddle as atb``)
and the framework-free core (``import atbcore``). ``python -m atb`` runs the ``atb``
command line, which does not need torch for ``--help``, ``--version`` or ``info``.
"""

from __future__ import annotations

import sys
from typing import Any

__all__: list[str] = []

_NO_TORCH = (
    "`import atb` is atb's PyTorch front-end and needs torch, which could not be imported "
    "({err}). Install it with `pip install torch==2.13.0` (or `pip install \"atb[torch]\"`), "
    "or use another front-end with the same names: `import atb_mindspore as atb` (MindSpore), "
    "`import atb_paddle as atb` (PaddlePaddle); the framework-free core is `import atbcore`.")


def _load() -> Any:
    """Import atb_torch and take its public names (once)."""
    try:
        import torch  # noqa: F401  (checked first so the error names what is missing)
    except ImportError as e:
        raise ImportError(_NO_TORCH.format(err=e), name="torch") from e
    import atb_torch

    module = sys.modules[__name__]
    loaded = vars(atb_torch)  # atb.compile/atb.LLM stay lazy: they load transformers
    for name in atb_torch.__all__:
        if name in loaded:
            setattr(module, name, loaded[name])
    module.__all__ = list(atb_torch.__all__)
    module.__version__ = atb_torch.__version__
    return atb_torch


def _run_as_main() -> bool:
    """True while runpy imports this package for ``python -m atb[.x]``: the command
    line must not pay for (or require) torch, so the front-end then loads on first use.
    Python sets ``sys.argv[0]`` to ``"-m"`` only while it locates the module."""
    if not sys.argv or sys.argv[0] != "-m":
        return False
    argv = getattr(sys, "orig_argv", [])
    target = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-m"), "")
    return target == __name__ or target.startswith(__name__ + ".")


_front_end = None if _run_as_main() else _load()


def __getattr__(name: str) -> Any:
    """Names not copied at import (``atb.compile``, ``atb.LLM``, or everything under
    ``python -m atb``) come from atb_torch on first use."""
    global _front_end
    if name.startswith("__") and name not in ("__all__", "__version__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _front_end is None:
        _front_end = _load()
        if name in ("__all__", "__version__"):
            return globals()[name]
    try:
        return getattr(_front_end, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
