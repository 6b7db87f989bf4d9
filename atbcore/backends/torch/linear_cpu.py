"""Linear on the CPU as one C matmul over panel-packed weights.

``y = x @ W^T * scale + bias`` with fp32 sums and one rounding, for fp32/bf16/fp16
weights and int8 ``w8`` weights with their per-channel scale, any row count (the
panels are read sequentially, each activation broadcast against a panel row);
``w4`` and ``w8a8`` weights run their own C kernels (:mod:`.linear_quant`). The
panels are made once per weight (:mod:`.weight_layout`), so a bound call, an unbound
one and every plan of a GraphOp read the same copy and compute the same bits. A
bound call with fixed buffers packs its C arguments once.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...runtime.binding import Slot, getter, resolve
from ...runtime.native_run import native_call, not_native, slots_of
from ..cpu_kernels import torch_ops as ck
from ..cpu_kernels.torch_decode import LINEAR_WEIGHT_DTYPES, linear_rows, linear_rows_bound
from ..cpu_kernels.torch_linear import linear_rows_bound_io
from .linear_quant import CpuQuantLinear, why_not_cpu_quant
from .weight_layout import PANELS_LAYOUT, packed_panels, panels, panels_enabled

__all__ = ["CpuLinear", "why_not_cpu_linear", "why_not_norm_weight", "bind_cpu_linear",
           "cpu_linear", "is_packed", "plain_ins"]


def is_packed(w: Any) -> bool:
    """Whether ``w`` is a layout pass's packed weight (:mod:`atbcore.graph.packed`)."""
    return type(w).__name__ == "PackedWeight"


def plain_ins(ins: dict[str, Any]) -> dict[str, Any]:
    """``ins`` with packed weights unpacked (a copy each: for paths that read the
    ``[out, in]`` tensor)."""
    if not any(is_packed(v) for v in ins.values()):
        return ins
    from ...runtime.binding import plain

    return {k: plain(v, "torch") if is_packed(v) else v for k, v in ins.items()}


def why_not_cpu_linear(p: Any, x_dtype: torch.dtype, device: str, w: Any, b: Any,
                       s: Any, z: Any = None) -> str | None:
    """Why the C matmul cannot run this Linear (None = it can)."""
    if not str(device).startswith("cpu"):
        return f"C kernels run on the CPU, not {device}"
    why = ck.unavailable_reason()
    if why:
        return why
    if b is not None and (b.desc.dtype.torch if type(b) is Slot else b.dtype) not in \
            ck.DTYPE_CODES:
        return "bias dtype"
    packed = is_packed(w)
    if p.quant in ("w4", "w8a8"):
        if x_dtype not in ck.DTYPE_CODES:
            return f"x {x_dtype}: not a C matmul dtype"
        return why_not_cpu_quant(p, w, s, z)
    if not panels_enabled():
        return "ATB_PANELS=0"
    wd = w.desc.dtype.torch if type(w) is Slot or packed else w.dtype
    if x_dtype not in ck.DTYPE_CODES or wd not in LINEAR_WEIGHT_DTYPES:
        return f"x {x_dtype} / weight {wd}: not a C matmul dtype pair"
    if (wd == torch.int8) != (p.quant == "w8"):
        return "int8 weights run as w8 only"
    if s is not None and (s.desc.dtype.torch if type(s) is Slot else s.dtype) != torch.float32:
        return "the C matmul takes an fp32 w8 scale"
    if type(w) is Slot:
        return "the weight changes per run"
    if packed:
        return None if w.layout.transposed == (not p.transpose_weight) else \
            "panels of the other orientation"
    if w.is_inference():
        return "an inference-mode weight (no version counter to keep its panels current)"
    return None


def why_not_norm_weight(nw: Any, k: int) -> str | None:
    """Why the C matmul cannot apply RmsNorm with weight ``nw`` to rows of ``k``."""
    if type(nw) is Slot:
        return "the norm weight changes per run"
    if nw.dtype not in ck.DTYPE_CODES or not nw.is_contiguous() or nw.numel() != k:
        return f"norm weight {nw.dtype} {tuple(nw.shape)}"
    return None


class CpuLinear:
    """One Linear's weight as panels (plus its bias and scale, and with ``norm`` =
    ``(eps, weight)`` the RmsNorm of its input rows), ready to run."""

    def __init__(self, p: Any, w: torch.Tensor, b: torch.Tensor | None,
                 s: torch.Tensor | None, norm: tuple[float, torch.Tensor] | None = None
                 ) -> None:
        self.panels, self.meta = packed_panels(w) if is_packed(w) else \
            panels(w, transposed=not p.transpose_weight)
        self.layout = PANELS_LAYOUT if p.quant is None else f"int8 {PANELS_LAYOUT} (w8)"
        self.bias, self.scale = b, s
        self.eps, self.norm_weight = norm if norm is not None else (None, None)

    def run(self, x: torch.Tensor, out: torch.Tensor | None = None,
            residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is not None and not residual.is_contiguous():
            residual = residual.contiguous()
        return linear_rows(x, self.meta, scale=self.scale, bias=self.bias, out=out,
                           panels=self.panels, rms_norm_eps=self.eps,
                           rms_norm_weight=self.norm_weight, residual=residual)

    def bound(self, x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None
              ) -> Callable[[], None] | None:
        """The call with these fixed buffers, its C arguments packed once."""
        if residual is not None and not residual.is_contiguous():
            return None
        return linear_rows_bound(x, self.meta, out, scale=self.scale, bias=self.bias,
                                 panels=self.panels, rms_norm_eps=self.eps,
                                 rms_norm_weight=self.norm_weight, residual=residual)

    def bound_io(self, x: Any, out: Any, residual: Any = None) -> Callable[..., None] | None:
        """``call(x, out[, residual])`` for tensors or :class:`Slot` s shaped as given
        (packed once but for the addresses)."""
        def like(t: Any) -> torch.Tensor:
            if type(t) is not Slot:
                return t
            return torch.empty(t.desc.shape, dtype=t.desc.dtype.torch)
        return linear_rows_bound_io(like(x), self.meta, like(out), scale=self.scale,
                                    bias=self.bias, panels=self.panels, rms_norm_eps=self.eps,
                                    rms_norm_weight=self.norm_weight,
                                    residual_like=None if residual is None else like(residual))


def cpu_linear(p: Any, w: torch.Tensor, b: torch.Tensor | None, s: torch.Tensor | None,
               norm: tuple[float, torch.Tensor] | None = None, z: torch.Tensor | None = None
               ) -> "CpuLinear | CpuQuantLinear":
    """The C matmul of this Linear's weights in the layout its quant mode runs."""
    if p.quant in ("w4", "w8a8"):
        return CpuQuantLinear(p, w, b, s, z, norm)
    return CpuLinear(p, w, b, s, norm)


def bind_cpu_linear(p: Any, ins: dict[str, Any], outs: list, ctx: Any
                    ) -> Callable[[list], None] | None:
    """The binder of Linear and RmsNormLinear (None where the C matmul cannot run:
    then the kernel's ``fn``)."""
    x, w, b, s = ins["x"], ins["weight"], ins.get("bias"), ins.get("scale")
    z = ins.get("zeros")
    xd = x.dtype if type(x) is not Slot else x.desc.dtype.torch
    dev = str(x.device) if type(x) is not Slot else x.desc.device
    if why_not_cpu_linear(p, xd, dev, w, b, s, z) is not None or type(b) is Slot \
            or type(s) is Slot:
        return None
    norm = None
    if "norm_weight" in ins:
        k = x.desc.shape[-1] if type(x) is Slot else x.shape[-1]
        if why_not_norm_weight(ins["norm_weight"], k) is not None:
            return None
        norm = (float(p.eps), ins["norm_weight"])
    r = ins.get("residual")
    lin, y = cpu_linear(p, w, b, s, norm, z), outs[0]
    ctx.note_layout("weight", lin.layout)
    xs = x.desc.shape if type(x) is Slot else x.shape
    ctx.note_pool_rows(_rows(xs))
    if Slot not in (type(x), type(y), type(r)):
        call = lin.bound(x, y, r)
        if call is not None:
            return native_call(lambda env: call(), getattr(call, "native", False))
    else:  # an input or output that changes per run: addresses packed per call
        io = lin.bound_io(x, y, r)
        if io is not None:
            gets = [getter(t) for t in ((x, y) if r is None else (x, y, r))]
            # its C call reads them by address alone (a strided one runs not_native)
            return native_call(lambda env: _io_or_run(io, lin, *[g(env) for g in gets]),
                               getattr(io, "native", False), slots_of([x, y, r]))
    return lambda env: lin.run(resolve(x, env), resolve(y, env), resolve(r, env))


bind_cpu_linear.takes_packed = True  # type: ignore[attr-defined]  # reads its panels as they are


def _io_or_run(io: Callable[..., None], lin: "CpuLinear", x: torch.Tensor, y: torch.Tensor,
               r: torch.Tensor | None = None) -> None:
    """The packed call for contiguous tensors, else the general one (a strided input)."""
    if x.is_contiguous() and y.is_contiguous() and (r is None or r.is_contiguous()):
        io(x, y) if r is None else io(x, y, r)
    else:
        not_native()
        lin.run(x, y, r)


def _rows(shape: Any) -> int:
    n = 1
    for d in tuple(shape)[:-1]:
        n *= int(d)
    return n
