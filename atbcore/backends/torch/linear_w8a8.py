"""Linear ``quant="w8a8"`` on the CPU: the C w8a8 matmul
(:mod:`atbcore.backends.cpu_kernels.torch_w8a8`) over the int8 weight packed once
(``pack_w8a8``, kept per weight tensor and version like the float panels of
:mod:`.weight_layout`), each row of x quantized on the fly, bias and residual added
in the epilogue, one rounding. Elsewhere (no C kernels, another device) the same
arithmetic in torch: rows quantized as the kernel does, fp32 matmul."""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch

from ...runtime.binding import Slot, getter
from ..cpu_kernels import torch_ops as ck

__all__ = ["w8a8_linear", "bind_w8a8_linear", "why_not_c_w8a8", "W8A8_LAYOUT"]

W8A8_LAYOUT = "int8 w8a8 panels (32 outputs x 4 k)"

_LOCK = threading.Lock()
_CACHE: dict[int, tuple[Any, int, int, torch.Tensor]] = {}


def _packed(w: torch.Tensor) -> torch.Tensor:
    """``pack_w8a8(w)``, made once per weight tensor and version."""
    from ..cpu_kernels.torch_w8a8 import pack_w8a8

    key = id(w)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None and hit[0]() is w and hit[1] == w._version and hit[2] == w.data_ptr():
            return hit[3]
    with torch.no_grad():
        packed = pack_w8a8(w.detach().contiguous())

    def drop(_ref: Any, key: int = key) -> None:
        with _LOCK:
            _CACHE.pop(key, None)
    with _LOCK:
        _CACHE[key] = (weakref.ref(w, drop), w._version, w.data_ptr(), packed)
    return packed


def why_not_c_w8a8(x: Any, w: Any, b: Any, s: Any, transpose_weight: bool) -> str | None:
    """Why the C w8a8 matmul cannot run this Linear (None = it can)."""
    def dt(t: Any) -> Any:
        return None if t is None else (t.desc.dtype.torch if type(t) is Slot else t.dtype)
    dev = x.desc.device if type(x) is Slot else str(x.device)
    if not str(dev).startswith("cpu"):
        return f"the C w8a8 matmul runs on the CPU, not {dev}"
    why = ck.unavailable_reason()
    if why:
        return why
    if type(w) is Slot or type(s) is Slot or type(b) is Slot:
        return "the weight, scale or bias changes per run"
    if not transpose_weight:
        return "an [in, out] int8 weight"
    if dt(x) not in ck.DTYPE_CODES or dt(s) != torch.float32 or \
            (b is not None and dt(b) not in ck.DTYPE_CODES):
        return f"x {dt(x)} / scale {dt(s)} / bias {dt(b)}: not the kernel's dtypes"
    if w.is_inference():
        return "an inference-mode weight (no version counter to keep its packing current)"
    return None


def _torch_w8a8(x: torch.Tensor, w: torch.Tensor, b: Any, s: torch.Tensor,
                transpose_weight: bool, r: Any) -> torch.Tensor:
    from ..cpu_kernels.torch_w8a8 import quantize_rows_reference

    q, sx = quantize_rows_reference(x)
    wf = w.float() * s.float()[:, None] if transpose_weight else (w.float() * s.float()).t()
    y = (q.float() * sx[..., None]) @ wf.t()
    if b is not None:
        y = y + b.float()
    if r is not None:
        y = y + r.float()
    return y.to(x.dtype)


def w8a8_linear(p: Any, ins: dict[str, Any], out: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's unbound call (``ins``: x, weight, bias?, scale, residual?)."""
    x, w, b, s, r = (ins["x"], ins["weight"], ins.get("bias"), ins.get("scale"),
                     ins.get("residual"))
    why = why_not_c_w8a8(x, w, b, s, p.transpose_weight)
    if why is None:
        from ..cpu_kernels.torch_w8a8 import linear_w8a8

        if r is not None and not r.is_contiguous():
            r = r.contiguous()
        return linear_w8a8(x, _packed(w), s, bias=b, out=out, residual=r)
    ck.log_fallback("Linear w8a8", why)
    return ck.into(None if out is None else [out], 0,
                   _torch_w8a8(x, w, b, s, p.transpose_weight, r))


def bind_w8a8_linear(p: Any, ins: dict[str, Any], outs: list, ctx: Any
                     ) -> Callable[[list], None] | None:
    """The bound call: weight packed once, x / out / residual read per run (None where
    the C kernel cannot run or the node also RmsNorms its rows: the kernel's fn)."""
    x, w, b, s, r = (ins["x"], ins["weight"], ins.get("bias"), ins.get("scale"),
                     ins.get("residual"))
    if "norm_weight" in ins or why_not_c_w8a8(x, w, b, s, p.transpose_weight) is not None:
        return None
    from ..cpu_kernels.torch_w8a8 import linear_w8a8

    packed = _packed(w)
    ctx.note_layout("weight", W8A8_LAYOUT)
    gx, gy = getter(x), getter(outs[0])
    gr = getter(r) if r is not None else (lambda env: None)

    def call(env: list) -> None:
        res = gr(env)
        if res is not None and not res.is_contiguous():
            res = res.contiguous()
        linear_w8a8(gx(env), packed, s, bias=b, out=gy(env), residual=res)
    return call
