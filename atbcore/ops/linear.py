"""Linear (with bias and quantized weights) and MatMul / BatchMatMul.

``Linear(x, weight, bias?, scale?, residual?, zeros?)``: ``y = x @ W.T + bias`` with
``W`` [out, in] (``transpose_weight=False``: W given as [in, out]). With
``quant="w8"`` the weight is int8 and ``scale`` holds one float per output channel:
``W = weight * scale[:, None]`` (see :func:`quantize_w8`), and x is read as int8 blocks
of 32 inputs per row, one fp32 scale each (``rint(x * 127 / max|x|)``, llama.cpp's Q8_0
activations; :func:`.linear_quant.act_q8`). ``quant="w8a8"``: int8 weights times
8-bit activations quantized per row over their range with a zero point
(:func:`.linear_quant.quantize_w8a8_rows`; the models' weights come from
:func:`.linear_quant.quantize_w8a8`); ``quant="w4"``: uint8 4-bit codes
``[out, in]`` with a scale (and optional zero point, ``zeros``) per output and group of
``group_size`` inputs (:mod:`.linear_quant`). x is ``[..., in]``.

``MatMul(a, b)``: ``op(a) @ op(b)`` with optional transposes of the last two dims
and broadcasting batch dims (numpy/torch ``matmul`` rules, rank >= 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..dtypes import Dtype
from ..errors import DtypeError, InputError, ShapeError
from ..tensor import TensorDesc
from .base import (FLOAT_DTYPES, OpDef, Params, expect_dtype, expect_param_dtype, expect_same_dtype,
                   f64)
from .linear_quant import (W4_GROUP, _check_group, _quant_weight, act_q8, check_quant_weight,
                           ref_w4, ref_w8a8, w4_groups)
from .registry import register_op

__all__ = ["LinearParams", "MatMulParams", "Linear", "MatMul", "quantize_w8", "dequantize_w8",
           "QUANT_TYPES", "LINEAR_FIELDS"]

# accepted spelling -> canonical quant mode
QUANT_TYPES = {"w8": "w8", "w8a16": "w8", "w8a32": "w8", "int8": "w8", "weight_int8": "w8",
               "w4": "w4", "int4": "w4", "w4a8": "w4", "w8a8": "w8a8"}
# the fields a fused op carrying a Linear (RmsNormLinear, LinearActivation) copies over
LINEAR_FIELDS = ("in_features", "out_features", "bias", "transpose_weight", "quant",
                 "group_size", "dtype")


def quantize_w8(weight: Any) -> tuple[Any, Any]:
    """Symmetric per-output-channel int8 quantization of ``weight`` [out, in].

    Returns ``(w_int8, scale)`` with ``scale = max|w| / 127`` per row (fp32; a zero
    row gets scale 1 so it dequantizes to zeros) and ``w_int8 = round(w / scale)``.
    Works on NumPy arrays and torch tensors (returns the same kind)::

        wq, s = quantize_w8(linear.weight)
        y, = Builder().build_operation("Linear", {"quant": "w8"}).execute([x, wq, s])
    """
    if isinstance(weight, np.ndarray) or not hasattr(weight, "detach"):
        w = _quant_weight("quantize_w8", weight)
        amax = np.abs(w).max(axis=1)
        scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
        q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
        return q, scale
    import torch

    w = weight.detach().float()
    check_quant_weight("quantize_w8", tuple(w.shape),
                       w.dim() != 2 or bool(torch.isfinite(w).all()))
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return q, scale


def dequantize_w8(w_int8: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``w_int8 * scale[:, None]`` in float64 (the reference's weight)."""
    return f64(w_int8) * f64(scale)[:, None]


# ----------------------------------------------------------------------------- Linear


@dataclass(frozen=True)
class LinearParams(Params):
    """``in_features``/``out_features`` (checked when given), ``bias`` (True: a bias
    input is required, False: refused, None: whatever is given), ``transpose_weight``
    (True: weight [out, in] as nn.Linear), ``quant`` (None, "w8", "w8a8" or "w4"),
    ``group_size`` (inputs per scale of "w4" weights, a multiple of 32), ``dtype``."""

    ALIASES = {"transpose_b": "transpose_weight", "transposeB": "transpose_weight",
               "quant_type": "quant", "hasBias": "bias"}
    in_features: int | None = None
    out_features: int | None = None
    bias: bool | None = None
    transpose_weight: bool = True
    quant: str | None = None
    dtype: Dtype | None = None
    group_size: int = W4_GROUP

    def linear(self) -> "LinearParams":
        """The plain Linear params of this (possibly fused-op) params object."""
        return LinearParams(**{f: getattr(self, f) for f in LINEAR_FIELDS})

    def validate(self) -> None:
        for name in ("in_features", "out_features"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0):
                self.fail(name, "a positive int or None", repr(v))
        if self.bias not in (None, True, False):
            self.fail("bias", "True, False or None", repr(self.bias))
        if self.quant is not None:
            key = str(self.quant).lower()
            if key != "none" and key not in QUANT_TYPES:
                self.fail("quant", f"None or one of {sorted(QUANT_TYPES)}", repr(self.quant))
            object.__setattr__(self, "quant", QUANT_TYPES.get(key))
        try:
            _check_group("Linear", self.group_size)
        except InputError:
            self.fail("group_size", "a multiple of 32", repr(self.group_size))
        if self.quant in ("w4", "w8a8") and not self.transpose_weight:
            self.fail("transpose_weight", f"True for quant={self.quant!r} (weight [out, in])",
                      "False")


def _check_linear(op: str, p: LinearParams, ins) -> TensorDesc:
    x, w, b, s = ins["x"], ins["weight"], ins.get("bias"), ins.get("scale")
    r, z = ins.get("residual"), ins.get("zeros")
    expect_dtype(op, "x", x, FLOAT_DTYPES)
    expect_param_dtype(op, p, "x", x)
    if x.rank < 2:
        raise ShapeError(op, "input 'x' rank", "rank >= 2 [..., in_features]", f"shape {list(x.shape)}")
    if w.rank != 2:
        want = "[out, in]" if p.transpose_weight else "[in, out]"
        raise ShapeError(op, "input 'weight' rank", f"rank 2 {want}", f"shape {list(w.shape)}")
    if z is not None and p.quant != "w4":
        raise InputError(op, "input 'zeros' given without quant='w4'", "no zeros", list(z.shape))
    if p.quant is not None:
        code = Dtype.UINT8 if p.quant == "w4" else Dtype.INT8
        expect_dtype(op, f"weight (quant {p.quant})", w, {code})
        if s is None:
            raise InputError(op, f"input 'scale' is missing (quant {p.quant})",
                             "a float scale tensor", "None")
    else:
        if w.dtype.is_integer:
            raise DtypeError(op, "input 'weight' dtype (integer weights need quant='w8', "
                             "'w8a8' or 'w4')",
                              x.dtype.name, w.dtype.name)
        expect_dtype(op, "weight", w, FLOAT_DTYPES)
        expect_same_dtype(op, "x", x, "weight", w)
        if s is not None:
            raise InputError(op, "input 'scale' given without quant='w8'", "no scale", list(s.shape))
    out_f, in_f = (w.shape[0], w.shape[1]) if p.transpose_weight else (w.shape[1], w.shape[0])
    if p.in_features is not None and x.shape[-1] != p.in_features:
        raise ShapeError(op, "input 'x' last dim (in_features)", p.in_features, f"shape {list(x.shape)}")
    if x.shape[-1] != in_f:
        lay = "[out, in]" if p.transpose_weight else "[in, out]"
        raise ShapeError(op, f"in_features mismatch: x last dim vs weight {lay}",
                         f"x [..., {in_f}] for weight {list(w.shape)}", f"x shape {list(x.shape)}")
    if p.out_features is not None and out_f != p.out_features:
        raise ShapeError(op, "input 'weight' out_features", p.out_features, f"shape {list(w.shape)}")
    if p.bias is True and b is None:
        raise InputError(op, "input 'bias' is missing (params bias=True)", f"a [{out_f}] tensor", "None")
    if p.bias is False and b is not None:
        raise InputError(op, "input 'bias' given with params bias=False", "no bias", list(b.shape))
    if b is not None:
        expect_dtype(op, "bias", b, FLOAT_DTYPES)
        if tuple(b.shape) != (out_f,):
            raise ShapeError(op, "input 'bias' shape", [out_f], list(b.shape))
    if s is not None and p.quant == "w4":
        expect_dtype(op, "scale", s, FLOAT_DTYPES)
        groups = [out_f, w4_groups(in_f, p.group_size)]
        if list(s.shape) != groups:
            raise ShapeError(op, f"input 'scale' shape (one per output and group of "
                             f"{p.group_size} inputs)", groups, list(s.shape))
        if z is not None:
            expect_dtype(op, "zeros", z, {Dtype.UINT8})
            if list(z.shape) != groups:
                raise ShapeError(op, "input 'zeros' shape (the scale's)", groups, list(z.shape))
    elif s is not None:
        expect_dtype(op, "scale", s, FLOAT_DTYPES)
        if tuple(s.shape) != (out_f,):
            raise ShapeError(op, "input 'scale' shape (one per output channel)", [out_f], list(s.shape))
    if r is not None:
        expect_same_dtype(op, "x", x, "residual", r)
        if tuple(r.shape) != (*x.shape[:-1], out_f):
            raise ShapeError(op, "input 'residual' shape (the output's)",
                             [*x.shape[:-1], out_f], list(r.shape))
    return TensorDesc((*x.shape[:-1], out_f), x.dtype, device=x.device)


def ref_linear(p: LinearParams, x: np.ndarray, w: np.ndarray, b: np.ndarray | None,
               s: np.ndarray | None, r: np.ndarray | None = None,
               z: np.ndarray | None = None) -> np.ndarray:
    """float64 ``x @ W.T + b [+ r]`` (W dequantized for w8; w8, w4 and w8a8 also
    quantize x as their kernels do: :mod:`.linear_quant`)."""
    if p.quant in ("w4", "w8a8"):
        y = ref_w4(x, w, s, z, p.group_size) if p.quant == "w4" else ref_w8a8(x, w, s)
        return y + (0.0 if b is None else f64(b)) + (0.0 if r is None else f64(r))
    xf = f64(x)
    if p.quant == "w8":   # one scale per output channel: rows of [out, in], columns of [in, out]
        wf = dequantize_w8(w, s) if p.transpose_weight else dequantize_w8(w.T, s)
        xf = act_q8(x)    # x in int8 blocks of 32, as the kernels read it
    else:
        wf = f64(w) if p.transpose_weight else f64(w).T
    y = xf @ wf.T
    if b is not None:
        y = y + f64(b)
    if r is not None:
        y = y + f64(r)
    return y


@register_op
class Linear(OpDef):
    name = "Linear"
    aliases = ("LinearOperation", "FullyConnected")
    Params = LinearParams
    inputs = ("x", "weight", "bias?", "scale?", "residual?", "zeros?")
    outputs = ("y",)

    def bind(self, p: Params, items: Sequence[Any]) -> dict[str, Any]:
        """With a ``quant`` mode, three inputs are (x, weight, scale) unless
        ``bias=True``; four are (x, weight, bias, scale). ``residual`` (shaped and
        typed as the output) is added to it: ``y = x @ W.T + bias + residual``, one
        rounding where the kernel fuses it (the ``linear_residual`` fusion); ``zeros``:
        the zero points of ``w4`` codes."""
        if p.quant is not None and len(items) == 3 and p.bias is not True:
            return {"x": items[0], "weight": items[1], "bias": None, "scale": items[2]}
        return super().bind(p, items)

    def infer_shape(self, p, ins):
        return [_check_linear(self.name, p, ins)]

    def reference(self, p, ins):
        x = ins["x"]
        y = ref_linear(p, x, ins["weight"], ins.get("bias"), ins.get("scale"),
                       ins.get("residual"), ins.get("zeros"))
        return [y.astype(np.asarray(x).dtype)]


# ----------------------------------------------------------------------------- MatMul


@dataclass(frozen=True)
class MatMulParams(Params):
    """``transpose_a`` / ``transpose_b`` swap the last two dims of a / b; ``dtype``."""

    ALIASES = {"trans_a": "transpose_a", "trans_b": "transpose_b", "transposeA": "transpose_a",
               "transposeB": "transpose_b", "adj_x": "transpose_a", "adj_y": "transpose_b"}
    transpose_a: bool = False
    transpose_b: bool = False
    dtype: Dtype | None = None

    def validate(self) -> None:
        for name in ("transpose_a", "transpose_b"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                self.fail(name, "True or False", repr(getattr(self, name)))


def broadcast_batch(op: str, a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    """Broadcast two batch shapes (right-aligned, 1 stretches) or raise ShapeError."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x != y and 1 not in (x, y):
            raise ShapeError(op, "batch dims of 'a' and 'b' must broadcast", list(a), list(b))
        out.append(max(x, y) if 1 in (x, y) else x)
    return tuple(out)


@register_op
class MatMul(OpDef):
    name = "MatMul"
    aliases = ("BatchMatMul", "BMM", "MatMulOperation")
    Params = MatMulParams
    inputs = ("a", "b")
    outputs = ("y",)

    def infer_shape(self, p, ins):
        a, b = ins["a"], ins["b"]
        for name, d in (("a", a), ("b", b)):
            expect_dtype(self.name, name, d, FLOAT_DTYPES)
            if d.rank < 2:
                raise ShapeError(self.name, f"input {name!r} rank", "rank >= 2",
                                 f"shape {list(d.shape)}")
        expect_param_dtype(self.name, p, "a", a)
        expect_same_dtype(self.name, "a", a, "b", b)
        m, k = (a.shape[-1], a.shape[-2]) if p.transpose_a else (a.shape[-2], a.shape[-1])
        k2, n = (b.shape[-1], b.shape[-2]) if p.transpose_b else (b.shape[-2], b.shape[-1])
        if k != k2:
            raise ShapeError(self.name, "inner dims of op(a) [.., M, K] and op(b) [.., K, N] "
                             f"(transpose_a={p.transpose_a}, transpose_b={p.transpose_b})",
                             f"b with K = {k}", f"a {list(a.shape)}, b {list(b.shape)}")
        batch = broadcast_batch(self.name, a.shape[:-2], b.shape[:-2])
        return [TensorDesc((*batch, m, n), a.dtype, device=a.device)]

    def reference(self, p, ins):
        a, b = f64(ins["a"]), f64(ins["b"])
        if p.transpose_a:
            a = np.swapaxes(a, -1, -2)
        if p.transpose_b:
            b = np.swapaxes(b, -1, -2)
        return [np.matmul(a, b).astype(np.asarray(ins["a"]).dtype)]
