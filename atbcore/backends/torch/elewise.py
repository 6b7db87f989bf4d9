"""Torch kernels for Elewise and ResidualAdd. Half types are computed in fp32 and
rounded once; integer types stay in their own dtype (wrap-around, like NumPy)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ...runtime.binding import Slot
from . import kernel

__all__ = ["elewise", "residual_add"]

_HALF = (torch.float16, torch.bfloat16)

_BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}
_UNARY = {"neg": torch.neg, "cos": torch.cos, "sin": torch.sin, "tanh": torch.tanh,
          "exp": torch.exp, "rsqrt": torch.rsqrt}


def _up(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _HALF else t


@kernel("Elewise", impl="torch elementwise (fp32 compute for fp16/bf16)")
def elewise(p, ins):
    x, y = ins["x"], ins.get("y")
    t = p.elewise_type
    if t == "cast":
        # copy=True: a cast to the same dtype must not hand back the input itself.
        return [x.to(p.out_dtype.torch, copy=True)]
    if t in _BINARY:
        z = _BINARY[t](_up(x), _up(y))
    elif t == "muls":
        z = torch.mul(_up(x), float(p.scalar))
    else:
        z = _UNARY[t](_up(x))
    return [z.to(x.dtype)]


def _bind_residual_add(p: Any, ins: Mapping[str, Any], outs: list, ctx: Any) -> Any:
    """fp32: ``torch.add(x, residual, out=...)`` into the planned buffer (or the
    output the program allocates)."""
    x, r, o = ins["x"], ins["residual"], outs[0]
    if any((t.desc.dtype.torch if type(t) is Slot else t.dtype) != torch.float32
           for t in (x, r, o)):
        return None
    get_x = (lambda env, i=x.index: env[i]) if type(x) is Slot else (lambda env: x)
    get_r = (lambda env, i=r.index: env[i]) if type(r) is Slot else (lambda env: r)
    get_o = (lambda env, i=o.index: env[i]) if type(o) is Slot else (lambda env: o)

    def call(env: list) -> None:
        torch.add(get_x(env), get_r(env), out=get_o(env))
    return call


@kernel("ResidualAdd", impl="torch.add (fp32 compute for fp16/bf16)", bind=_bind_residual_add)
def residual_add(p, ins):
    x = ins["x"]
    return [torch.add(_up(x), _up(ins["residual"])).to(x.dtype)]
