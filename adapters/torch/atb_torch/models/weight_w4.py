"""Weights of ``quantize="w4"``: group-wise 4-bit codes packed for the C w4 matmul
(:mod:`atbcore.backends.cpu_kernels.torch_linear_w4`).

A Linear's weight is quantized here (symmetric, group 32: Q4_0's information content)
unless its tensor was loaded from a GPTQ/AWQ checkpoint (:mod:`.gptq_load`), whose exact
codes, scales and zero points are registered in :data:`PREQUANTIZED` under the float
tensor they dequantize to: those are packed as they are, not quantized again.
"""

from __future__ import annotations

import torch

from atbcore.models.quant import PREQUANTIZED, W4Codes  # the registry the core lowering reads

from .weight_prep import Prep

__all__ = ["W4Codes", "PREQUANTIZED", "W4_GROUP", "w4_reason", "w4_weight"]

W4_GROUP = 32  # inputs per scale of weights quantized at compile time


def w4_reason(prep: Prep) -> str:
    """Why the C w4 matmul cannot run these Linears ('' = it can); then the weights
    are dequantized and run as dense ones."""
    if prep.device.type != "cpu":
        return f"C kernels run on the CPU, not {prep.device.type}"
    if prep.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"dtype {prep.dtype}"
    from atbcore.backends.cpu_kernels import unavailable_reason

    return unavailable_reason() or ""


def _codes(param: torch.Tensor, w: torch.Tensor, group: int) -> W4Codes:
    from atbcore.backends.cpu_kernels.torch_linear_w4 import quantize_w4

    known = PREQUANTIZED.get(param)
    if known is not None and known.group == group:
        return known
    codes, scales, zeros, group = quantize_w4(w, group, symmetric=True)
    return W4Codes(codes, scales, zeros, group)


def w4_weight(params: list, ws: list) -> "object":
    """The packed :class:`~atbcore.backends.cpu_kernels.torch_linear_w4.W4Weight` of the
    weights ``ws`` ([out, in] each, detached from ``params``) merged along outputs."""
    from atbcore.backends.cpu_kernels.torch_linear_w4 import pack_w4

    known = [c for c in map(PREQUANTIZED.get, params) if c is not None]
    group = known[0].group if known else W4_GROUP
    parts = [_codes(p, w, group) for p, w in zip(params, ws)]
    codes = torch.cat([c.codes for c in parts])
    scales = torch.cat([c.scales for c in parts])
    zeros = None
    if any(c.zeros is not None for c in parts):
        zeros = torch.cat([c.zeros if c.zeros is not None else
                           torch.full_like(c.scales, 8, dtype=torch.uint8) for c in parts])
    return pack_w4(codes, scales, zeros, group, k=ws[0].shape[1])
