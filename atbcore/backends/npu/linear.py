"""The torch backend's NPU kernel for weight-only int8 Linear (``quant="w8"``):
``torch_npu.npu_weight_quant_batchmatmul`` (W8A16).

atb keeps a w8 weight ``[out, in]`` int8 with one scale per output channel; the op
takes ``x (M, K)`` fp16/bf16, the weight ``(K, N)`` (the transposed view is passed,
no copy) and ``antiquant_scale (N,)`` in x's dtype. Rounding fp32 scales to fp16 or
bf16 here would miss DESIGN.md's tolerance (measured against the reference: fp16 max
relative error 1.2e-3 > 1e-3), so the kernel takes scales that are values of x's
dtype: given in it, or fp32 scales that convert exactly, which is how a lowered
fp16/bf16 model quantizes them (:func:`atbcore.models.quant.linear_layer`). The
converted scales are made once per scale tensor (and version) and reused. The bias
goes into the op (fp16/fp32 documented; a bf16 bias is widened to fp32, exactly), so
the output is rounded once.

The op is W8A16: x is read as given, not as the int8 blocks of 32 that the CPU kernels
and the op's reference quantize it to (a half x cannot carry q * dx exactly), so on the
NPU w8 is the more exact product, within that activation rounding of the reference.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Mapping

import torch

from ..torch.device_kernels import device_kernel
from . import into_out, npu_module, soc_family, unavailable_reason

__all__ = ["weight_quant_reasons", "scale_in"]

_LOCK = threading.Lock()
# (id(scale), dtype) -> (weakref to it, version, address, the scale in dtype or None)
_SCALES: dict[tuple[int, torch.dtype], tuple[Any, int, int, Any]] = {}


def scale_in(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``s`` in ``dtype`` when every value converts exactly (else None), made once per
    scale tensor and version: a plan's weights are checked and converted on the
    first call, not per step (the check reads the values back from the device)."""
    if s.dtype == dtype:
        return s
    key = (id(s), dtype)
    with _LOCK:
        hit = _SCALES.get(key)
        if hit is not None and hit[0]() is s and hit[1] == s._version and \
                hit[2] == s.data_ptr():
            return hit[3]
    with torch.no_grad():
        c = s.to(dtype).contiguous()
        c = c if torch.equal(c.to(s.dtype), s) else None

    def drop(_ref: Any) -> None:
        with _LOCK:
            _SCALES.pop(key, None)
    with _LOCK:
        _SCALES[key] = (weakref.ref(s, drop), s._version, s.data_ptr(), c)
    return c


def weight_quant_reasons(p: Any, ins: Mapping[str, Any]) -> str | None:
    """Why ``npu_weight_quant_batchmatmul`` cannot take this Linear call."""
    why = unavailable_reason()
    if why:
        return why
    if p.quant != "w8":
        return "not weight-only int8 (the float Linear is torch's matmul on NPU)"
    fam = soc_family()
    if fam not in ("A2", "A3"):
        return f"npu_weight_quant_batchmatmul is used on A2/A3 only; SoC family {fam}"
    x, w, s = ins["x"], ins["weight"], ins.get("scale")
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"npu_weight_quant_batchmatmul takes fp16/bf16 x; given {str(x.dtype)[6:]}"
    if w.dtype != torch.int8 or w.dim() != 2:
        return "the weight must be a 2-D int8 tensor"
    if not p.transpose_weight:
        return "weight given [in, out]: atb's w8 scales are per output row of [out, in]"
    if s is None or s.dim() != 1:
        return "one scale per output channel is needed"
    if s.dtype != x.dtype and (s.dtype != torch.float32 or scale_in(s, x.dtype) is None):
        return (f"{str(x.dtype)[6:]} x with {str(s.dtype)[6:]} scales that are not values of "
                f"{str(x.dtype)[6:]}: the op takes scales in x's dtype, and rounding them here "
                "misses the tolerance")
    return None


@device_kernel("Linear", "npu", why_not=weight_quant_reasons, provider="torch_npu",
               available=unavailable_reason,
               impl="torch_npu.npu_weight_quant_batchmatmul (w8; fp32 scales given in x's "
               "dtype, converted exactly once per scale tensor)")
def linear_w8_npu(p: Any, ins: Mapping[str, Any], out: list | None = None) -> list:
    x, w, b = ins["x"], ins["weight"], ins.get("bias")
    s = scale_in(ins["scale"], x.dtype)                                  # exact: checked
    x2 = x.reshape(-1, x.shape[-1]).contiguous()                         # [M, K]
    if b is not None and b.dtype not in (torch.float16, torch.float32):
        b = b.float()
    y = npu_module().npu_weight_quant_batchmatmul(
        x2, w.t(), s, bias=None if b is None else b.contiguous())       # [M, N]
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    r = ins.get("residual")
    if r is not None:  # the linear_residual fusion's add, after the op (fp32 sum)
        from ..torch.linear import add_residual

        y = add_residual(y, r)
    return [into_out(out, 0, y)]
