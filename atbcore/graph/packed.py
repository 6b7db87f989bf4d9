"""Weight constants held in the layout their kernel reads (:class:`PackedWeight`).

The layout pass (:mod:`atbcore.passes.layout`) asks the backend in which layout each
weight is read and rewrites the graph's constant into it, so the graph's
``weight_map`` holds the packed form only (no unpacked copy beside it). A
:class:`PackedWeight` keeps its logical descriptor (``[N, K]`` and dtype, what shape
inference, the verifier and ``explain()`` see) and its packed elements (``data``):

* kernels that read the layout take it as it is (``takes_packed`` binders and
  kernel functions: the C matmul on 32-output panels);
* everything else sees the logical tensor through :func:`unpack` (the layout's
  inverse): unbound execution by a kernel that does not read the layout,
  ``to_numpy``, saving a graph. Unpacking makes a temporary copy.

``PackedWeight`` is a tensor kind of its own for :mod:`atbcore.tensor` (``describe``,
``to_numpy`` and ``convert`` work on it), so code that only asks for descriptors or
values needs no change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dtypes import Dtype
from ..errors import ShapeError
from ..tensor import TensorDesc, _Bridge, convert, register_bridge

__all__ = ["PackedWeight", "Layout", "PANELS", "PANEL", "W4", "W8A8", "pack", "pack_joint",
           "unpack", "is_packed"]

PANEL = 32


@dataclass(frozen=True)
class Layout:
    """A weight layout: ``name`` (shown by ``explain()``) and whether the packed
    matrix is the transpose of the stored one (a weight kept ``[K, N]``). A layout of
    several tensors packed together (w4: codes, group scales, zero points) names the
    node input each packed tensor stands for (``part``; see :func:`pack_joint`) and
    its ``group`` size."""

    name: str
    transposed: bool = False
    part: str = ""
    group: int = 0

    def describe(self) -> str:
        if self.part:
            what = {"weight": "codes", "scale": "group scales", "zeros": "zero points"}
            return f"{self.name}, group {self.group}: {what.get(self.part, self.part)}"
        return self.name + (" (of the transposed [K, N] weight)" if self.transposed else "")


PANELS = "32-output panels"
W8A8 = "w8a8 VNNI panels"  # int8 [P, K/4 + 1, 32, 4], last row the column sums
W4 = "w4 32-output panels"  # parts: weight (4-bit codes), scale, zeros
# layout name -> "module:function" packing it (``fn(arrays by part, layout) -> raw
# packed arrays by part``), imported when first used: the packers are the kernels' own
PACKERS = {W8A8: "atbcore.backends.torch.linear_quant:pack_w8a8_layout",
           W4: "atbcore.backends.torch.linear_quant:pack_w4_layout"}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _pack_panels(w: np.ndarray) -> np.ndarray:
    """``[N, K]`` -> ``[ceil(N / 32), K, 32]`` (``p[i, k, j] = w[32 i + j, k]``, zeros
    past N), as raw unsigned elements of ``w``'s width."""
    from ..backends.cpu_kernels.native_panels import pack_panels_raw

    return pack_panels_raw(w)


def _unpack_panels(p: np.ndarray, n: int) -> np.ndarray:
    k = p.shape[1]
    return np.ascontiguousarray(p.transpose(0, 2, 1).reshape(-1, k)[:n])


class PackedWeight:
    """A weight constant in ``layout`` (see the module docstring). ``data``: the packed
    elements (a NumPy array, or the same memory as another framework's tensor after
    :meth:`native`); ``desc``: the logical descriptor."""

    __slots__ = ("data", "desc", "layout", "__weakref__")

    def __init__(self, data: Any, desc: TensorDesc, layout: Layout) -> None:
        self.data, self.desc, self.layout = data, desc, layout

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.desc.shape)

    @property
    def dtype(self) -> Dtype:
        """The logical dtype (an atb :class:`~atbcore.dtypes.Dtype`)."""
        return self.desc.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the packed elements (what the model holds for this weight)."""
        d = self.data
        n = getattr(d, "nbytes", None)
        if n is None:  # a torch tensor
            n = d.numel() * d.element_size()
        return int(n)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """``np.asarray(w)``: the logical array (unpacked, a copy)."""
        a = unpack(self)
        return a if dtype is None else a.astype(dtype)

    def native(self, framework: str) -> "PackedWeight":
        """The same weight with ``data`` as ``framework``'s tensor (same memory): a torch
        tensor for torch's kernels, NumPy for every other front-end (its packed layouts
        are read by the framework-free C kernels, :mod:`atbcore.backends.cpu_kernels.
        native_layout`)."""
        data = self.data
        if framework == "torch" and isinstance(data, np.ndarray):
            # raw unsigned elements -> the logical dtype (same width), same memory
            signed = data.view({1: np.int8, 2: np.int16, 4: np.int32}[data.dtype.itemsize])
            data = convert(signed, "torch").view(self.desc.dtype.torch)
        elif not isinstance(data, np.ndarray):  # the framework-free C kernels read NumPy
            data = self.numpy_data()
        else:
            return self
        return PackedWeight(data, self.desc, self.layout)

    def numpy_data(self) -> np.ndarray:
        """The packed elements as raw unsigned NumPy elements of the weight's width."""
        d = self.data
        if not isinstance(d, np.ndarray):
            import torch

            d = d.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[d.element_size()]).numpy()
        return d.view(_UINT[d.dtype.itemsize])

    def __repr__(self) -> str:
        return (f"PackedWeight({list(self.desc.shape)} {self.desc.dtype.value}, "
                f"{self.layout.describe()}, {self.nbytes} B)")


def is_packed(x: Any) -> bool:
    return type(x) is PackedWeight


def _packer(name: str) -> Any:
    import importlib

    spec = PACKERS.get(name)
    if spec is None:
        raise ShapeError("pack", "layout", f"{PANELS} or one of {sorted(PACKERS)}", name)
    mod, fn = spec.split(":")
    return getattr(importlib.import_module(mod), fn)


def pack(arr: Any, layout: Layout) -> PackedWeight:
    """``arr`` (any framework's 2-D CPU tensor) packed into ``layout`` (a layout of
    one tensor: 32-output panels or w8a8's)."""
    a = np.ascontiguousarray(convert(arr, "numpy"))
    if a.ndim != 2:
        raise ShapeError("pack", "weight rank", 2, list(a.shape))
    desc = TensorDesc(a.shape, Dtype.of(a.dtype))
    if layout.name != PANELS:
        return pack_joint({"weight": a}, {"weight": layout})["weight"]
    src = np.ascontiguousarray(a.T) if layout.transposed else a
    return PackedWeight(_pack_panels(src), desc, layout)


def pack_joint(arrays: dict[str, Any], layouts: dict[str, Layout]) -> dict[str, PackedWeight]:
    """The node inputs ``arrays`` (by input name) packed together into one layout of
    several tensors (``layouts``: each input's part of it): a :class:`PackedWeight`
    per input, each holding its own packed tensor (their bytes add up to the
    layout's), made by the layout's packer in one go (w4's padding codes are the
    zero points)."""
    names = {lay.name for lay in layouts.values()}
    if len(names) != 1 or set(arrays) != set(layouts):
        raise ShapeError("pack_joint", "layouts", "one layout for every given input",
                         f"{sorted(names)} for {sorted(layouts)} of {sorted(arrays)}")
    lay = next(iter(layouts.values()))
    arrs = {k: np.ascontiguousarray(convert(a, "numpy")) for k, a in arrays.items()}
    raw = _packer(lay.name)(arrs, lay)
    return {k: PackedWeight(raw[k], TensorDesc(a.shape, Dtype.of(a.dtype)), layouts[k])
            for k, a in arrs.items()}


def unpack(w: PackedWeight) -> np.ndarray:
    """The logical array of ``w`` (a new NumPy array of its dtype)."""
    p = w.numpy_data()
    dt = w.desc.dtype.numpy
    if w.layout.name != PANELS:
        from .packed_quant import unpack_quant

        return unpack_quant(p, w.layout, tuple(w.desc.shape)).view(dt)
    n = w.desc.shape[1] if w.layout.transposed else w.desc.shape[0]
    m = _unpack_panels(p, n).view(dt)
    return np.ascontiguousarray(m.T) if w.layout.transposed else m


class _PackedBridge(_Bridge):
    """``describe`` / ``to_numpy`` / ``to_torch`` of a :class:`PackedWeight`: its
    logical tensor (unpacked, a copy)."""

    name = "packed"

    def matches(self, x: Any) -> bool:
        return type(x) is PackedWeight

    def describe(self, x: Any) -> TensorDesc:
        return x.desc

    def to_numpy(self, x: Any) -> np.ndarray:
        return unpack(x)

    def to_torch(self, x: Any) -> Any:
        return convert(unpack(x), "torch")

    def from_torch(self, t: Any) -> Any:
        raise ShapeError("PackedWeight", "conversion", "a packed weight made by pack()",
                         "a plain tensor")


register_bridge(_PackedBridge())
