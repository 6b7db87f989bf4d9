"""Weight layouts the framework-free C kernels read: the layout chooser of the NumPy
backend, atb_mindspore and atb_paddle (:data:`atbcore.passes.layout.CHOOSERS`), and
the views those kernels take of a weight the layout pass packed.

The C matmul of Linear / RmsNormLinear and of FusedFeedForward's projections
(:mod:`.native_specs`) streams weights in 32-output panels. Without the pass it packs
them at binding, beside the stored ``[N, K]`` array (:func:`.native_panels.panel_view`),
and hands calls of more than ``MAX_ROWS`` rows to the framework's GEMM on the stored
array. With a weight the pass packed (a :class:`~atbcore.graph.packed.PackedWeight`,
held in the graph instead of the stored array) the C matmul runs at every row count
on those panels, as the torch backend's does; a call the C kernels cannot take at all
(a strided input, an activation a plugin replaced) unpacks a copy for the framework.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ...dtypes import Dtype
from .native import DTYPE_CODES, WEIGHT_CODES, NativeView

__all__ = ["native_chooser", "preferred_layout", "is_packed", "packed_view", "plain_ins"]


def is_packed(x: Any) -> bool:
    return type(x).__name__ == "PackedWeight"


def packed_view(w: Any) -> NativeView | None:
    """The logical ``[N, K]`` view of a weight packed in (untransposed) 32-output
    panels: its address is the panels' (the C matmul reads them through
    :func:`.native_panels.panel_view`, which knows such a view by its owner). None for
    another layout (then the kernel reads it unpacked)."""
    from ...graph.packed import PANELS

    if w.layout.name != PANELS or w.layout.transposed or len(w.desc.shape) != 2:
        return None
    raw = w.numpy_data()
    n, k = (int(d) for d in w.desc.shape)
    return NativeView(raw.ctypes.data, (n, k), (k, 1), w.desc.dtype, w)


def packed_panels(w: NativeView) -> NativeView | None:
    """The panels behind a :func:`packed_view` (None for any other view)."""
    if not is_packed(w.owner):
        return None
    raw = w.owner.numpy_data()
    return NativeView(raw.ctypes.data, raw.shape, tuple(s // raw.itemsize for s in raw.strides),
                      w.dtype, raw)


def plain_ins(ins: Mapping[str, Any], framework: str) -> dict[str, Any]:
    """``ins`` with packed weights unpacked into ``framework``'s tensors (a copy each)."""
    from ...runtime.binding import plain

    return {k: plain(v, framework) if is_packed(v) else v for k, v in ins.items()}


def _dtype_ok(d: Any, codes: Any = DTYPE_CODES) -> bool:
    return d is None or d.dtype in codes


def _layout(op: str, p: Any, name: str, descs: Mapping[str, Any]) -> Any:
    from ...graph.packed import PANELS, Layout
    from .native_panels import _enabled
    from .native_specs import c_activation

    w, x = descs.get(name), descs.get("x")
    if w is None or x is None or len(w.shape) != 2 or not str(w.device).startswith("cpu"):
        return None
    if not _enabled() or not _dtype_ok(x) or w.dtype not in WEIGHT_CODES:
        return None
    if not all(_dtype_ok(descs.get(n)) for n in ("bias", "norm_weight", "residual")):
        return None
    if op in ("Linear", "RmsNormLinear") and name == "weight":
        if p.quant not in (None, "w8") or (w.dtype == Dtype.INT8) != (p.quant == "w8"):
            return None
        s = descs.get("scale")
        if not p.transpose_weight or (s is not None and s.dtype != Dtype.FP32):
            return None
        return Layout(PANELS)
    if op == "FusedFeedForward" and name.endswith("_w"):
        from ...ops.ffn import ffn_layout

        if c_activation(p.activation_type)[1] or w.dtype not in DTYPE_CODES:
            return None
        if not all(_dtype_ok(d) for k, d in descs.items() if k.endswith(("_w", "_b"))):
            return None
        shapes = {k: tuple(d.shape) for k, d in descs.items() if d is not None}
        return None if any(ffn_layout(op, p, shapes).transposed.values()) else Layout(PANELS)
    return None


def native_chooser(backend: str) -> Callable[..., Any]:
    """The chooser of backend ``backend`` (its kernel table, loaded when first asked,
    runs the C kernels): the layout its C matmul reads weight ``name`` of ``op`` in at
    every row count, or None."""

    def preferred_layout(op: str, p: Any, name: str, descs: Mapping[str, Any]) -> Any:
        from .. import get_backend
        from . import unavailable_reason
        from .native_specs import SPECS

        if op not in SPECS or unavailable_reason():
            return None
        b = get_backend(backend)
        if b.unavailable_reason():
            return None
        b.load()
        k = b.kernels.get(op)
        if k is None or getattr(k.fn, "__qualname__", "") != f"native_{op}":
            return None  # this backend runs the op its own way
        return _layout(op, p, name, descs)
    return preferred_layout


preferred_layout = native_chooser("numpy_c")  # the NumPy front-end's C kernels
