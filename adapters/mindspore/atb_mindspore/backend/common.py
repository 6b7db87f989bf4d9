"""Helpers shared by the MindSpore kernels: fp32 compute for half types, casts,
index tensors, and the record of which path (fused or composed) a kernel took."""

from __future__ import annotations

import threading
from typing import Any, Mapping

from atbcore.log import logger
from atbcore.tensor import TensorDesc

from .._env import ascend_ops, mindspore, on_ascend

__all__ = ["ms", "ops", "mint", "f32", "is_half", "cast", "to_dtype", "arange", "descs", "note",
           "PATHS", "on_ascend", "swap_last", "host_ints", "const", "NEG_INF"]

NEG_INF = float("-inf")

# op -> (path, why) of the latest call, e.g. ("composed", "ops.rms_norm is Ascend-only")
PATHS: dict[str, tuple[str, str]] = {}
_SEEN: set[tuple[str, str, str]] = set()
_LOCK = threading.Lock()


def ms() -> Any:
    """The mindspore module (initialised, see :mod:`atb_mindspore._env`)."""
    return mindspore()


def ops() -> Any:
    """``mindspore.ops`` (or a test's stand-in for its Ascend ops: :mod:`.._env`)."""
    return ascend_ops()


def mint() -> Any:
    return mindspore().mint


def is_half(t: Any) -> bool:
    m = mindspore()
    return t.dtype in (m.float16, m.bfloat16)


def f32(t: Any) -> Any:
    """``t`` in fp32 (half types are upcast; None passes through)."""
    if t is None:
        return None
    m = mindspore()
    return t if t.dtype == m.float32 else t.astype(m.float32)


def cast(t: Any, dtype: Any) -> Any:
    """``t`` as ``dtype`` (a MindSpore dtype); no-op when it already is."""
    return t if t.dtype == dtype else t.astype(dtype)


def to_dtype(d: Any) -> Any:
    """The MindSpore dtype of an atb :class:`~atbcore.dtypes.Dtype`."""
    from ..bridge import ms_dtype

    return ms_dtype(d)


def arange(start: int, stop: int | None = None) -> Any:
    """An int64 ``arange`` (``mint.arange`` has no CPU kernel in 2.10)."""
    m = mindspore()
    if stop is None:
        start, stop = 0, start
    return m.ops.arange(int(start), int(stop), dtype=m.int64)


def const(value: float, dtype: Any) -> Any:
    """A 0-d tensor (``mint.full`` has no CPU kernel in 2.10)."""
    m = mindspore()
    return m.Tensor(value, dtype)


def swap_last(t: Any) -> Any:
    """``t`` with its last two dims swapped (a view)."""
    return mindspore().mint.transpose(t, -1, -2)


def host_ints(t: Any) -> list[int]:
    """Values of a small integer tensor as Python ints (one host sync)."""
    return [int(v) for v in t.asnumpy().reshape(-1).tolist()]


def descs(ins: Mapping[str, Any]) -> dict[str, TensorDesc | None]:
    """Descriptors of a kernel's inputs."""
    return {n: None if x is None else TensorDesc.of(x) for n, x in ins.items()}


def note(op: str, path: str, why: str = "") -> None:
    """Record (and log once at DEBUG) which implementation ``op`` used and why."""
    PATHS[op] = (path, why)
    key = (op, path, why)
    if key not in _SEEN:
        with _LOCK:
            _SEEN.add(key)
        logger.debug("%s [mindspore]: %s%s", op, path, f" ({why})" if why else "")
