"""MindSpore kernels for Elewise and ResidualAdd. Float types are computed in fp32
and rounded once; integer add/sub/mul/neg stay in their own dtype (wrap-around, as
NumPy and torch do)."""

from __future__ import annotations

from . import kernel
from .common import cast, f32, mint, to_dtype

__all__: list[str] = []

_FLOAT = ("Float16", "BFloat16", "Float32", "Float64")


def _is_float(t) -> bool:
    return str(t.dtype) in _FLOAT


def _binary(name: str):
    mt = mint()
    return {"add": mt.add, "sub": mt.sub, "mul": mt.mul, "div": mt.div}[name]


def _unary(name: str):
    mt = mint()
    return {"neg": mt.neg, "cos": mt.cos, "sin": mt.sin, "tanh": mt.tanh, "exp": mt.exp,
            "rsqrt": mt.rsqrt}[name]


def _check(p, ins):
    x = ins["x"]
    if p.elewise_type in ("add", "sub", "mul", "neg") and x.dtype.name in ("INT8", "UINT8"):
        # MindSpore 2.10 has no 8-bit integer arithmetic kernels on the CPU
        return [f"mindspore has no {x.dtype.name} {p.elewise_type} CPU kernel"]
    return []


@kernel("Elewise", check=_check, impl="mindspore mint elementwise (fp32 compute for fp16/bf16)")
def elewise(p, ins):
    x, y = ins["x"], ins.get("y")
    t = p.elewise_type
    if t == "cast":
        want = to_dtype(p.out_dtype)
        # a cast to the same dtype must still hand back a new tensor
        return [x.copy() if x.dtype == want else x.astype(want)]
    if not _is_float(x):
        z = _binary(t)(x, y) if y is not None else _unary(t)(x)
        return [cast(z, x.dtype)]
    if t == "muls":
        z = mint().mul(f32(x), float(p.scalar))
    elif y is not None:
        z = _binary(t)(f32(x), f32(y))
    else:
        z = _unary(t)(f32(x))
    return [cast(z, x.dtype)]


@kernel("ResidualAdd", impl="mindspore mint.add (fp32 compute for fp16/bf16)")
def residual_add(p, ins):
    x = ins["x"]
    return [cast(mint().add(f32(x), f32(ins["residual"])), x.dtype)]


