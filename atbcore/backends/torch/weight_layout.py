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


def packed_panels(w: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A layout pass's packed weight (:class:`atbcore.graph.packed.PackedWeight`, torch
    data in 32-output panels) as :func:`panels` returns it: the panels as they are and
    a meta tensor of the ``[N, K]`` matrix the kernel computes with."""
    n, k = w.desc.shape[::-1] if w.layout.transposed else w.desc.shape
    return w.data, torch.empty((n, k), dtype=w.desc.dtype.torch, device="meta")


def preferred_layout(op: str, p: Any, name: str, descs: dict[str, Any]) -> Any:
    """The layout the torch CPU kernel of ``op`` reads weight input ``name`` in at every
    row count (an :class:`atbcore.graph.packed.Layout`), or None when it reads the
    weight as it is (or may: then the layout pass leaves it alone). ``descs``: the
    node's input descriptors by name. Asked by :mod:`atbcore.passes.layout`."""
    from ...graph.packed import PANELS, W4, W8A8, Layout
    from ..cpu_kernels import torch_ops as ck
    from ..cpu_kernels.torch_decode import LINEAR_WEIGHT_DTYPES

    w, x = descs.get(name), descs.get("x")
    if w is None or x is None or len(w.shape) != 2 or not str(w.device).startswith("cpu"):
        return None
    if not panels_enabled() or ck.unavailable_reason():
        return None
    xd, wd = x.dtype.torch, w.dtype.torch
    if xd not in ck.DTYPE_CODES:
        return None
    if op in ("Linear", "RmsNormLinear") and p.quant in ("w4", "w8a8"):
        return _quant_layout(p, name, descs, W4 if p.quant == "w4" else W8A8, Layout)
    if op in ("Linear", "RmsNormLinear") and name == "weight":
        if p.quant not in (None, "w8") or wd not in LINEAR_WEIGHT_DTYPES:
            return None
        if (wd == torch.int8) != (p.quant == "w8"):
            return None
        b, s = descs.get("bias"), descs.get("scale")
        if b is not None and b.dtype.torch not in ck.DTYPE_CODES:
            return None
        if s is not None and s.dtype.torch != torch.float32:
            return None
        return Layout(PANELS, transposed=not p.transpose_weight)
    if op == "FusedFeedForward" and name.endswith("_w"):
        from ...ops.ffn import ffn_layout
        from .activation import c_activation

        if c_activation(p.activation)[1] or wd not in ck.DTYPE_CODES:
            return None
        shapes = {k: tuple(d.shape) for k, d in descs.items() if d is not None}
        return Layout(PANELS, transposed=bool(ffn_layout(op, p, shapes).transposed[name]))
    return None


def _quant_layout(p: Any, name: str, descs: dict[str, Any], kind: str, layout: Any) -> Any:
    """w4 / w8a8 Linears (their C kernels run at every row count): w8a8 reads its int8
    ``weight`` in VNNI panels (its fp32 ``scale`` as stored); w4 reads codes, fp16
    group scales and zero points packed together (one layout of three parts)."""
    from ..cpu_kernels import torch_ops as ck

    b, s, w = descs.get("bias"), descs.get("scale"), descs.get("weight")
    if b is not None and b.dtype.torch not in ck.DTYPE_CODES:
        return None
    if s is None or w is None or len(s.shape) != (2 if p.quant == "w4" else 1):
        return None
    if p.quant == "w8a8":
        ok = name == "weight" and w.dtype.torch == torch.int8 and s.dtype.torch == torch.float32
        return layout(kind) if ok else None
    z = descs.get("zeros")
    if name not in ("weight", "scale", "zeros") or w.dtype.torch != torch.uint8 or \
            s.dtype.torch != torch.float16 or (z is not None and z.dtype.torch != torch.uint8):
        return None
    return layout(kind, part=name, group=int(p.group_size))
