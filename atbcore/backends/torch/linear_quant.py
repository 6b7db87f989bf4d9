"""Linear with ``quant="w4"`` or ``"w8a8"`` on torch tensors: on the CPU the C kernels
(:mod:`~atbcore.backends.cpu_kernels.torch_linear_w4`, :mod:`~atbcore.backends.
cpu_kernels.torch_w8a8`) over weights packed once into their layouts (in the binding
GraphOp's huge-page weight arena), elsewhere the same arithmetic in torch ops.

A packed layout is made once per weight tensor and version (as the float panels of
:mod:`.weight_layout`), so every plan of a GraphOp and an unbound call read one copy.
The C kernels take a residual as an addend of the output they accumulate into: a
residual that is not the output buffer itself is copied there first.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import torch

__all__ = ["W4_LAYOUT", "W8A8_LAYOUT", "CpuQuantLinear", "why_not_cpu_quant",
           "quant_linear_torch"]

W4_LAYOUT = "w4 32-output panels (4-bit codes, fp16 group scales{zeros}, group {group})"
W8A8_LAYOUT = "w8a8 VNNI panels (int8 [P, K/4 + 1, 32, 4], column sums)"

_LOCK = threading.Lock()
# (id(weight), mode) -> (weakref to it, version, address, packed layout)
_CACHE: dict[tuple[int, str], tuple[Any, int, int, Any]] = {}


def _cached(w: torch.Tensor, mode: str, make: Callable[[], Any]) -> Any:
    key = (id(w), mode)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None and hit[0]() is w and hit[1] == w._version and hit[2] == w.data_ptr():
            return hit[3]
    with torch.no_grad():
        packed = make()

    def drop(_ref: Any) -> None:
        with _LOCK:
            _CACHE.pop(key, None)
    with _LOCK:
        _CACHE[key] = (weakref.ref(w, drop), w._version, w.data_ptr(), packed)
    return packed


def _arena_copy(t: torch.Tensor) -> torch.Tensor:
    from ...memory import hugepages

    out = hugepages.weight_empty(tuple(t.shape), t.dtype)
    return out.copy_(t)


def _w4(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, group: int) -> Any:
    """The :class:`~atbcore.backends.cpu_kernels.torch_linear_w4.W4Weight` of codes ``w``
    uint8 [N, K], fp16 scales ``s`` and zero points ``z`` [N, G] (padding codes past K
    are the zero point: zero weights)."""
    from ..cpu_kernels.torch_linear_w4 import pack_w4

    n, k = w.shape
    codes = torch.full((n, s.shape[1] * group), 8, dtype=torch.uint8)
    if z is not None:
        codes[:, k:] = z[:, -1:]                       # the last group's zero point
    codes[:, :k] = w
    return pack_w4(codes, s, z, group, k=k)


def w4_packed(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, group: int) -> Any:
    """:func:`_w4` made once per codes tensor and version, in the arena."""
    from ..cpu_kernels.torch_linear_w4 import W4Weight

    def make() -> Any:
        p = _w4(w, s, z, group)
        return W4Weight(_arena_copy(p.codes), _arena_copy(p.scales),
                        None if p.zeros is None else _arena_copy(p.zeros), p.n, p.k, group)
    return _cached(w, "w4", make)


def w8a8_packed(w: torch.Tensor) -> torch.Tensor:
    """The int8 weight ``w`` [N, K] in the w8a8 kernel's VNNI panels, in the arena."""
    from ...memory import hugepages
    from ..cpu_kernels.torch_w8a8 import pack_w8a8, w8a8_shape

    return _cached(w, "w8a8", lambda: pack_w8a8(
        w.contiguous(), out=hugepages.weight_empty(w8a8_shape(*w.shape), torch.int8)))


def _raw(t: torch.Tensor) -> Any:
    """``t`` copied into weight bytes (the binding GraphOp's arena when in scope) as raw
    unsigned NumPy elements of its width (what a PackedWeight holds)."""
    import numpy as np

    from ..cpu_kernels.native_panels import _weight_bytes

    size = t.element_size()
    u = {1: np.uint8, 2: np.uint16}[size]
    out = _weight_bytes(t.numel() * size).view(u).reshape(tuple(t.shape))
    np.copyto(out, t.contiguous().view({1: torch.int8, 2: torch.int16}[size]).numpy().view(u))
    return out


def pack_w8a8_layout(arrays: dict[str, Any], layout: Any) -> dict[str, Any]:
    """The layout pass's packer of ``w8a8 VNNI panels`` (:mod:`atbcore.graph.packed`):
    the int8 ``weight`` by the kernel's own :func:`pack_w8a8`."""
    from ..cpu_kernels.torch_w8a8 import pack_w8a8

    return {"weight": _raw(pack_w8a8(torch.from_numpy(arrays["weight"])))}


def pack_w4_layout(arrays: dict[str, Any], layout: Any) -> dict[str, Any]:
    """The layout pass's packer of ``w4 32-output panels``: codes (``weight``), fp16
    group scales (``scale``) and zero points (``zeros``, if any) by :func:`pack_w4`."""
    z = arrays.get("zeros")
    p = _w4(torch.from_numpy(arrays["weight"]), torch.from_numpy(arrays["scale"]),
            None if z is None else torch.from_numpy(z), layout.group)
    out = {"weight": _raw(p.codes), "scale": _raw(p.scales)}
    if p.zeros is not None:
        out["zeros"] = _raw(p.zeros)
    return out


def _from_layout(w: Any, s: Any, z: Any, group: int) -> Any:
    """The W4Weight of the layout pass's packed parts (torch data: the same memory)."""
    from ..cpu_kernels.torch_linear_w4 import W4Weight

    n, k = w.desc.shape
    return W4Weight(w.data, s.data, None if z is None else z.data, int(n), int(k), group)


def why_not_cpu_quant(p: Any, w: Any, s: Any, z: Any) -> str | None:
    """Why the C w4 / w8a8 kernel cannot run this Linear's weights (None = it can);
    the caller has checked the device, x's dtype and the bias."""
    from ...graph.packed import W4, W8A8
    from ...runtime.binding import Slot

    if Slot in (type(w), type(s), type(z)):
        return "the weight changes per run"
    if type(w).__name__ == "PackedWeight":  # the layout pass's: checked by its chooser
        want = W4 if p.quant == "w4" else W8A8
        parts = (w, s, z) if p.quant == "w4" else (w,)
        ok = all(t is None or (type(t).__name__ == "PackedWeight" and t.layout.name == want)
                 for t in parts)
        return None if ok else "a packed weight of another layout"
    if p.quant == "w4":
        if s.dtype != torch.float16:
            return f"the C w4 matmul takes fp16 group scales, given {s.dtype}"
    elif s.dtype != torch.float32:
        return "the C w8a8 matmul takes an fp32 per-channel scale"
    if w.is_inference():
        return "an inference-mode weight (no version counter to keep its layout current)"
    return None


class CpuQuantLinear:
    """One w4 or w8a8 Linear's packed weight (with its bias, scale and, with ``norm`` =
    ``(eps, weight)``, the RmsNorm of its input rows), ready to run; the interface of
    :class:`~.linear_cpu.CpuLinear`."""

    def __init__(self, p: Any, w: torch.Tensor, b: torch.Tensor | None, s: torch.Tensor,
                 z: torch.Tensor | None, norm: tuple[float, torch.Tensor] | None = None
                 ) -> None:
        self.quant, self.bias = p.quant, b
        self.eps, self.norm_weight = norm if norm is not None else (None, None)
        packed = type(w).__name__ == "PackedWeight"  # the layout pass's: taken as it is
        if p.quant == "w4":
            self.w4 = _from_layout(w, s, z, p.group_size) if packed else \
                w4_packed(w, s, z, p.group_size)
            self.layout = W4_LAYOUT.format(group=p.group_size,
                                           zeros="" if z is None else ", zero points")
        else:
            self.packed = w.data if packed else w8a8_packed(w)
            self.scale = s.contiguous()
            self.layout = W8A8_LAYOUT

    def _kw(self) -> dict[str, Any]:
        return {"bias": self.bias, "rms_norm_eps": self.eps,
                "rms_norm_weight": self.norm_weight}

    def run(self, x: torch.Tensor, out: torch.Tensor | None = None,
            residual: torch.Tensor | None = None) -> torch.Tensor:
        from ..cpu_kernels.torch_linear_w4 import linear_w4
        from ..cpu_kernels.torch_w8a8 import linear_w8a8

        if self.quant == "w8a8":
            if residual is not None and not residual.is_contiguous():
                residual = residual.contiguous()
            return linear_w8a8(x, self.packed, self.scale, out=out, residual=residual,
                               **self._kw())
        return linear_w4(x, self.w4, out=out, residual=residual, **self._kw())

    def bound(self, x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None
              ) -> Callable[[], None] | None:
        """The call with these fixed buffers, its C arguments packed once (w4 adds the
        residual in its epilogue; w8a8 copies a residual other than ``out`` into ``out``,
        which its kernel accumulates into)."""
        from ..cpu_kernels.torch_linear_w4 import linear_w4_bound
        from ..cpu_kernels.torch_w8a8 import linear_w8a8_bound

        acc = residual is not None
        if acc and (not residual.is_contiguous() or residual.shape != out.shape):
            return None
        if self.quant == "w4":
            return linear_w4_bound(x, self.w4, out, residual=residual, **self._kw())
        else:
            call = linear_w8a8_bound(x, self.packed, self.scale, out, accumulate=acc,
                                     **self._kw())
        if call is None or not acc or residual.data_ptr() == out.data_ptr():
            return call

        def with_residual() -> None:
            out.copy_(residual)
            call()
        return with_residual

    def bound_io(self, x: Any, out: Any, residual: Any = None) -> Callable[..., None] | None:
        """w4: ``call(x, out[, residual])`` with the addresses packed per call (a plan's
        input or fresh output, e.g. the LM head's logits); w8a8: None (the binder calls
        :meth:`run`). ``x``/``out``/``residual`` describe the tensors (``.desc`` of a
        slot, or the tensor)."""
        if self.quant != "w4":
            return None
        from ..cpu_kernels.torch_linear_w4 import linear_w4_bound_io

        like = [_like(t) for t in (x, out, residual)]
        if any(t is None for t in like[:2]) or (residual is not None and like[2] is None):
            return None
        return linear_w4_bound_io(like[0], self.w4, like[1], residual_like=like[2],
                                  **self._kw())


def _like(t: Any) -> torch.Tensor | None:
    """A tensor shaped and typed as ``t`` (a tensor, or a :class:`Slot` described by its
    ``desc``); None for what is neither."""
    from ...runtime.binding import Slot

    if type(t) is Slot:
        return torch.empty(t.desc.shape, dtype=t.desc.dtype.torch)
    return t if isinstance(t, torch.Tensor) else None


def _quant_rows_w8a8(x: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] fp32 as the w8a8 kernel quantizes it (per row over its range, a zero
    point: :func:`atbcore.ops.linear_quant.quantize_w8a8_rows`), dequantized."""
    lo = x.amin(-1, keepdim=True).clamp(max=0)
    rng = x.amax(-1, keepdim=True).clamp(min=0) - lo
    inv = torch.where(rng > 0, torch.tensor(254.0, device=x.device) / rng,  # true division
                      torch.zeros_like(rng))
    z = torch.where(rng > 0, 1 - torch.round(lo * inv), torch.full_like(rng, 128.0))
    u = torch.round(x * inv).add_(z).clamp_(1, 255)
    return (u - z) * (rng / 254.0)


def _quant_x(x: torch.Tensor, block: int | None) -> torch.Tensor:
    """``x`` [M, K] fp32 as the C kernels quantize it, dequantized (fp32 [M, K'])."""
    if block is None:
        return _quant_rows_w8a8(x)
    m, k = x.shape
    b = k if block is None else block
    kp = -(-k // b) * b
    xp = torch.zeros(m, kp, dtype=torch.float32, device=x.device)
    xp[:, :k] = x
    blocks = xp.view(m, kp // b, b)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0, device=x.device) / amax,  # true division
                      torch.zeros_like(amax))
    q = torch.round(blocks * inv).clamp_(-127, 127)
    return (q * (amax / 127.0)).view(m, kp)


def quant_linear_torch(p: Any, x: torch.Tensor, w: torch.Tensor, b: Any, s: torch.Tensor,
                       z: Any) -> torch.Tensor:
    """w4 / w8a8 in torch ops (fp32, one rounding to x's dtype): the op's arithmetic
    where the C kernels cannot run."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k).float()
    if p.quant == "w4":
        g = p.group_size
        sf = s.float().repeat_interleave(g, 1)[:, :k]
        zf = 8.0 if z is None else z.float().repeat_interleave(g, 1)[:, :k]
        wf = (w.float() - zf) * sf                                        # [N, K]
        y = _quant_x(x2, 32)[:, :k] @ wf.t()
    else:
        y = (_quant_x(x2, None) @ w.float().t()) * s.float()
    if b is not None:
        y = y + b.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
