"""Weight layouts the CPU kernels read, made once per weight tensor and shared.

The C matmul (:func:`atbcore.backends.cpu_kernels.torch_decode.linear_rows`) streams a
weight packed in 32-output panels (``pack_panels``): each activation element is
broadcast against a panel row, with no horizontal sums, at any row count. A kernel
asks :func:`panels` for the packed form of a ``[out, in]`` weight (or the transposed
view of an ``[in, out]`` one); the packing is done once and kept as long as the
weight tensor lives, keyed by the tensor and its version counter, so an in-place
update (``load_state_dict``) repacks at the next use. Plans, their bound programs
and the kernels' unbound calls all read the same panels, so they compute the same
bits.

``ATB_PANELS=0`` keeps the ``[out, in]`` layout (less memory; the C matmul then runs
only for few rows and torch's GEMM for more).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

import torch

__all__ = ["panels", "panels_enabled", "layout_name", "PANELS_LAYOUT"]

PANELS_LAYOUT = "32-output panels"

_LOCK = threading.Lock()
# id(weight tensor) -> (weakref to it, version, address, panels); an entry goes with
# its tensor (tensors compare element-wise, so they cannot key a WeakKeyDictionary)
_CACHE: dict[tuple[int, bool], tuple[Any, int, int, tuple[torch.Tensor, torch.Tensor]]] = {}


def _forget(key: tuple[int, bool]) -> Any:
    def drop(_ref: Any) -> None:
        with _LOCK:
            _CACHE.pop(key, None)
    return drop


def panels_enabled() -> bool:
    """False when ``ATB_PANELS=0`` asks for the ``[out, in]`` layout."""
    return os.environ.get("ATB_PANELS", "1").strip().lower() not in ("0", "off", "false", "no")


def panels(w: torch.Tensor, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[N, K]`` (``transposed``: ``w`` is ``[K, N]``) as ``pack_panels``' panels,
    made once per weight tensor and version, with a meta tensor ``[N, K]`` of its
    dtype (what the C matmul is given as the weight beside the panels)."""
    from ..cpu_kernels.torch_decode import pack_panels

    key = (id(w), transposed)
    with _LOCK:
        hit = _CACHE.get(key)
        if (hit is not None and hit[0]() is w and hit[1] == w._version
                and hit[2] == w.data_ptr()):
            return hit[3]
    src = w.t() if transposed else w
    from ...memory import hugepages
    n, k = src.shape
    with torch.no_grad():
        packed = pack_panels(src.detach().contiguous(),
                             out=hugepages.weight_empty((-(-n // 32), k, 32), src.dtype))
    meta = torch.empty(tuple(src.shape), dtype=w.dtype, device="meta")
    with _LOCK:
        _CACHE[key] = (weakref.ref(w, _forget(key)), w._version, w.data_ptr(), (packed, meta))
    return packed, meta


def layout_name(use_panels: bool) -> str:
    """The layout a Linear's weight is read in, for logs and ``explain()``."""
    return PANELS_LAYOUT if use_panels else "[out, in] rows"
