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

__all__ = ["mindspore", "device_name", "on_ascend", "use_ascend_ops", "ascend_ops"]

_LOCK = threading.Lock()
_READY = False
# stand-ins for MindSpore's Ascend ops (a test's conformance double): while one is
# installed, CPU tensors stand for Ascend ones and the fused branches call the double
_ASCEND_OPS: list[Any] = []


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
    if getattr(t, "_atb_array", None) is not None:  # made by atb over a host array
        return "cpu"  # (asking MindSpore waits for its queue of pending ops)
    dev = str(getattr(t, "device", "CPU") or "CPU")
    kind, _, idx = dev.partition(":")
    kind = {"cpu": "cpu", "ascend": "npu", "npu": "npu", "gpu": "cuda", "cuda": "cuda"}.get(
        kind.strip().lower(), kind.strip().lower())
    if kind == "cpu":
        return "cpu"
    return f"{kind}:{idx or 0}"


def on_ascend(t: Any) -> bool:
    """True for a tensor on an Ascend NPU (where MindSpore's fused kernels exist), or
    a CPU tensor standing for one while :func:`use_ascend_ops` is active."""
    name = device_name(t)
    return name.startswith("npu") or (bool(_ASCEND_OPS) and name == "cpu")


def ascend_ops() -> Any:
    """``mindspore.ops``, or the installed stand-in (which forwards what it does not
    define to ``mindspore.ops``)."""
    return _ASCEND_OPS[-1] if _ASCEND_OPS else mindspore().ops


@contextlib.contextmanager
def use_ascend_ops(double: Any) -> Any:
    """Tests: run the Ascend branches of the MindSpore kernels against ``double`` (a
    conformance double of ``ops.rms_norm`` & co.), CPU tensors standing for Ascend ones."""
    _ASCEND_OPS.append(double)
    try:
        yield double
    finally:
        _ASCEND_OPS.remove(double)
