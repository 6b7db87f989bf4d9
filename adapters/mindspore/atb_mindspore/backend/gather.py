"""MindSpore kernels for Gather and Embedding (``ops.gather``). Index ranges were
checked by the op's ``check_values`` before these run. MindSpore 2.10 has no bf16
gather on the CPU: bf16 tables are gathered as fp32 (a widening, so exact)."""

from __future__ import annotations

from typing import Any

from . import kernel
from .common import cast, ms, ops

__all__: list[str] = []


def _take(x: Any, idx: Any, axis: int) -> Any:
    m = ms()
    src = x.astype(m.float32) if x.dtype == m.bfloat16 else x
    y = ops().gather(src, idx.astype(m.int64), axis)   # shape x[:axis] + idx + x[axis+1:]
    return cast(y, x.dtype)


@kernel("Gather", impl="mindspore ops.gather")
def gather(p, ins):
    x = ins["x"]
    return [_take(x, ins["indices"], p.axis % x.ndim)]


@kernel("Embedding", impl="mindspore ops.gather on axis 0")
def embedding(p, ins):
    return [_take(ins["weight"], ins["ids"], 0)]
