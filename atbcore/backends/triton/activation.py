"""Triton gated activations: ``act(gate) * up`` in fp32, one rounding.

``gated(x, act)`` splits ``x`` ``[..., 2n]`` into ``[gate | up]``; with ``up`` given,
``x`` is the gate. ``act`` is the C kernels' activation name: "silu" (SwiGLU),
"gelu" (erf GeGLU) or "gelu_tanh".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rounding import round_to

__all__ = ["gated", "ACTIVATIONS"]

ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
_BLOCK = 1024


@triton.jit
def _gated_kernel(g_ptr, u_ptr, y_ptr, n_cols, g_row, u_row, ACT: tl.constexpr,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * g_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_row + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g))
    elif ACT == 1:
        a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
    else:  # tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * z)) - 1.0))
    tl.store(y_ptr + row * n_cols + cols, round_to(a * u, y_ptr), mask=mask)


def gated(x: torch.Tensor, act: str, up: torch.Tensor | None = None,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """``act(gate) * up``: ``[..., n]`` in x's dtype (into ``out`` when it fits)."""
    xc = x.contiguous()
    if up is None:
        n = xc.shape[-1] // 2
        gate, upt, row = xc, xc[..., n:], 2 * n
        shape = (*xc.shape[:-1], n)
    else:
        n = xc.shape[-1]
        gate, upt, row = xc, up.contiguous(), n
        shape = tuple(xc.shape)
    y = out if (out is not None and tuple(out.shape) == shape and out.dtype == x.dtype
                and out.is_contiguous() and out.device == x.device) \
        else torch.empty(shape, dtype=x.dtype, device=x.device)
    rows = y.numel() // n if n else 0
    if rows:
        _gated_kernel[(rows, triton.cdiv(n, _BLOCK))](gate, upt, y, n, row, row,
                                                     ACT=ACTIVATIONS[act], BLOCK=_BLOCK)
    if out is not None and y is not out:
        y = out.copy_(y)
    return y
