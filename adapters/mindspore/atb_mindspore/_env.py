"""Importing MindSpore for atb: once, quietly, with its NumPy C-API initialised.

MindSpore 2.10 wheels are built against NumPy 1.x. With NumPy 2 installed, the
first call that parses a Python sequence argument (``x.reshape((2, 3))``) tries to
initialise NumPy's C API inside MindSpore, fails once with a ``SystemError`` and a
page of warnings on stderr, and works from then on (numbers and tuples are parsed
without NumPy). :func:`mindspore` triggers that first failure on a throw-away
tensor, so no user call ever sees it.
"""

from __future__ import annotations

import contextlib
import io
import threading
from typing import Any

__all__ = ["mindspore", "device_name", "on_ascend"]

_LOCK = threading.Lock()
_READY = False


def mindspore() -> Any:
    """The ``mindspore`` module, ready for atb's kernels."""
    global _READY
    import mindspore as ms

    if not _READY:
        with _LOCK:
            if not _READY:
                import numpy as np

                buf = io.StringIO()
                with contextlib.redirect_stderr(buf):
                    try:
                        ms.Tensor(np.zeros(2, np.float32)).reshape((1, 2))
                    except SystemError:
                        pass  # the one-time NumPy C-API failure described above
                _READY = True
    return ms


def device_name(t: Any) -> str:
    """atb's device name of a MindSpore tensor: ``cpu``, ``npu:0``, ``cuda:0``."""
    dev = str(getattr(t, "device", "CPU") or "CPU")
    kind, _, idx = dev.partition(":")
    kind = {"cpu": "cpu", "ascend": "npu", "npu": "npu", "gpu": "cuda", "cuda": "cuda"}.get(
        kind.strip().lower(), kind.strip().lower())
    if kind == "cpu":
        return "cpu"
    return f"{kind}:{idx or 0}"


def on_ascend(t: Any) -> bool:
    """True for a tensor on an Ascend NPU (where MindSpore's fused kernels exist)."""
    return device_name(t).startswith("npu")
