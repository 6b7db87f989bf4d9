"""The backend registry and the dispatcher.

Dispatch walks backends by priority, takes the first with no reasons against the
call, and logs each backend it passed over with its reasons at INFO, e.g.
``FlashAttention: torch skipped (head_dim 72 ...) -> numpy``, and the backend and
kernel it chose, e.g. ``RmsNorm: backend torch, kernel c_rms_norm``. A choice is
logged once per distinct call signature (op, params, input shapes and dtypes), so a
plan build logs its ops and the calls that replay a plan or repeat an op log nothing.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from typing import Any, Mapping

from ..errors import CapabilityError
from ..log import logger
from ..ops.base import OpDef, Params
from ..tensor import TensorDesc
from .base import Backend, Kernel
from .numpy_backend import NumpyBackend, NumpyNativeBackend
from .torch import TorchBackend

__all__ = ["Backend", "Kernel", "register_backend", "get_backend", "backends", "select_backend"]

_BACKENDS: dict[str, Backend] = {}
# Signatures whose choice was logged already (bounded: shapes can vary without end).
_LOGGED: "OrderedDict[Any, None]" = OrderedDict()
_LOGGED_MAX = 4096


def register_backend(backend: Backend) -> None:
    """Add (or replace) a backend; plugins call this through ``atb_register_backends``."""
    _BACKENDS[backend.name] = backend


def backends() -> list[Backend]:
    """All registered backends, highest priority (lowest number) first."""
    return sorted(_BACKENDS.values(), key=lambda b: b.priority)


def get_backend(name: str) -> Backend:
    if name not in _BACKENDS:
        raise CapabilityError("backend", "unknown backend", sorted(_BACKENDS), repr(name))
    return _BACKENDS[name]


def select_backend(opdef: OpDef, p: Params, ins: Mapping[str, TensorDesc | None],
                   prefer: str | None = None, framework: str | None = None
                   ) -> tuple[Backend, list[tuple[str, list[str]]]]:
    """The backend to run this call, and the (backend, reasons) passed over.

    Backends marked ``native_first`` whose native tensors are the caller's
    ``framework`` are asked first
    (a MindSpore user's tensors stay in MindSpore kernels), then by priority."""
    prefer = prefer or os.environ.get("ATB_BACKEND") or None
    order = sorted(backends(), key=lambda b: (not (b.native_first and b.native == framework), b.priority)) if framework \
        else backends()
    if prefer:
        order = [get_backend(prefer)]
    skipped: list[tuple[str, list[str]]] = []
    for b in order:
        reasons = b.not_supported_reasons(opdef, p, ins)
        if not reasons:
            if logger.isEnabledFor(logging.INFO) and _first_time(opdef, p, ins, b):
                for name, why in skipped:
                    logger.info("%s: %s skipped (%s) -> %s", opdef.name, name, "; ".join(why),
                                b.name)
                k = b.kernel(opdef.name)
                logger.info("%s: backend %s, kernel %s", opdef.name, b.name,
                            getattr(k, "impl", None) or "-")
            return b, skipped
        skipped.append((b.name, reasons))
    detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in skipped)
    raise CapabilityError(opdef.name, "no backend can run this call", "a backend with a kernel",
                          detail)


def _first_time(opdef: OpDef, p: Params, ins: Mapping[str, TensorDesc | None],
                b: Backend) -> bool:
    """True the first time this (op, params, inputs, backend) is chosen (for the log)."""
    try:
        key: Any = (opdef.name, b.name, p, tuple(sorted(ins.items())))
        hash(key)
    except TypeError:  # unhashable params or descriptors: one line per op and backend
        key = (opdef.name, b.name)
    if key in _LOGGED:
        return False
    _LOGGED[key] = None
    if len(_LOGGED) > _LOGGED_MAX:
        _LOGGED.popitem(last=False)
    return True


register_backend(TorchBackend())
register_backend(NumpyBackend())
register_backend(NumpyNativeBackend())
