"""The torch backend's NPU kernel for FusedFeedForward: the two projections as
torch matmuls (torch_npu's own GEMMs on the device), the gated activation as
``torch_npu.npu_swiglu`` on the merged gate|up output, the norm (``norm_ffn``) as
``npu_rms_norm`` where it takes the call, and a residual (``ffn_residual``) as the
down projection's ``addmm`` input. On an NPU the pass pipeline keeps those two
fusions off (:mod:`atbcore.backends.fusion_choices`: the add and the next norm make
one ``npu_add_rms_norm``); a GraphOp written with them still runs here. gate|up and
the activation are rounded to x's dtype between the ops, as the device ops do:
within the op's fp16 tolerance, not bf16's, so bf16 runs the torch kernel (fp32
inside).
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import torch

from ...ops.ffn import ffn_layout
from ...ops.registry import get_op
from ..torch.device_kernels import device_kernel
from ..torch.linear import add_residual
from . import into_out, npu_module, unavailable_reason

__all__ = ["ffn_reasons"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def ffn_reasons(p: Any, ins: Mapping[str, Any]) -> str | None:
    """Why the NPU FusedFeedForward (matmuls + ``npu_swiglu``) cannot take this call."""
    why = unavailable_reason()
    if why:
        return why
    if p.activation_type != "swiglu":
        return f"activation {p.activation_type!r}: torch_npu's fused one here is npu_swiglu"
    if not p.gate_up_merged:
        return "gate and up weights apart: npu_swiglu splits one merged [..., 2I] projection"
    x = ins["x"]
    if x.dtype not in _FLOATS:
        return f"npu_swiglu takes fp16/bf16/fp32; given {str(x.dtype)[6:]}"
    if x.dtype == torch.bfloat16:
        return ("bf16: gate|up and the activation rounded to bf16 between the ops miss the "
                "fused op's bf16 tolerance")
    return None


def _proj(x2: torch.Tensor, w: torch.Tensor, b: Any, transposed: bool) -> torch.Tensor:
    """``x2 @ W^T (+ b)`` in x's dtype; ``transposed``: W arrived ``[in, out]``."""
    if transposed:
        return torch.mm(x2, w) if b is None else torch.addmm(b, x2, w)
    return torch.nn.functional.linear(x2, w, b)


@functools.lru_cache(maxsize=16)
def _norm_params(eps: float) -> Any:
    return get_op("RmsNorm").make_params({"eps": eps})


def _normed(p: Any, ins: Mapping[str, Any]) -> torch.Tensor:
    """x, RmsNorm'd first when the op carries its norm: ``npu_rms_norm`` where it
    takes the call, else the RmsNorm kernel (as the torch FFN kernel does)."""
    if p.norm_eps is None:
        return ins["x"]
    from ..torch.device_kernels import DEVICE_KERNELS
    from ..torch.ffn import _normed as torch_normed

    norm, nins = _norm_params(p.norm_eps), {"x": ins["x"], "weight": ins["norm_weight"]}
    dk = DEVICE_KERNELS[("RmsNorm", "npu")]
    return dk.fn(norm, nins)[0] if dk.why_not(norm, nins) is None else torch_normed(p, ins)


@device_kernel("FusedFeedForward", "npu", why_not=ffn_reasons, provider="torch_npu",
               available=unavailable_reason,
               impl="torch_npu: matmul, npu_swiglu, matmul (+ the RmsNorm kernel, residual add)")
def ffn_npu(p: Any, ins: Mapping[str, Any], out: list | None = None) -> list:
    x = ins["x"]
    lay = ffn_layout("FusedFeedForward", p,
                     {n: tuple(t.shape) for n, t in ins.items() if t is not None})
    x2 = _normed(p, ins).reshape(-1, lay.hidden)                              # [T, H]
    gu = _proj(x2, ins["gate_up_w"], ins.get("gate_up_b"), lay.transposed["gate_up_w"])
    h = npu_module().npu_swiglu(gu.contiguous(), dim=-1)                      # [T, I]
    r, wd = ins.get("residual"), ins["down_w"]
    if r is None:
        y = _proj(h, wd, ins.get("down_b"), lay.transposed["down_w"])        # [T, H]
    else:  # the residual as addmm's input: accumulated with the product, rounded once
        y = torch.addmm(r.reshape(-1, lay.hidden), h, wd if lay.transposed["down_w"] else wd.t())
        if ins.get("down_b") is not None:
            y = add_residual(y, ins["down_b"])
    return [into_out(out, 0, y.reshape(x.shape))]
