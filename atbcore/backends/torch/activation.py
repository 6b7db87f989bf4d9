"""Torch kernels for the activation ops: the registry's torch function on fp32
(half types are upcast once and the result rounded once)."""

from __future__ import annotations

from typing import Any, Callable

from ...ops.activation import get_activation
from . import kernel

__all__: list[str] = []


def _make(op: str) -> Callable[[Any, dict], list]:
    def run(p: Any, ins: dict) -> list:
        x, up = ins["x"], ins.get("up")
        act = get_activation(p.activation_name(), op)
        y = act.torch(x.float(), None if up is None else up.float())
        return [y.to(x.dtype)]

    run.__qualname__ = f"activation_{op}"
    return run


# (op, launches): gated ones are act(gate) then a multiply
for _op, _launches in (("Gelu", 1), ("QuickGelu", 1), ("SiLU", 1), ("Relu", 1), ("SwiGLU", 2),
                       ("GeGLU", 2), ("Activation", 2)):
    kernel(_op, impl="activation registry torch fn (fp32 compute)", launches=_launches)(_make(_op))
