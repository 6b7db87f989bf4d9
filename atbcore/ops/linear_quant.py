"""Quantized Linear weights and activations in NumPy: the quantizers that make them and
the float64 references of ``Linear(quant="w4" | "w8a8")`` (``"w8"`` is
:func:`atbcore.ops.linear.quantize_w8`).

* ``w4`` — group-wise 4-bit weights: codes ``q`` uint8 ``[N, K]`` in [0, 15], one
  scale per output and group of ``group_size`` inputs (``[N, ceil(K / group)]``) and
  optional uint8 zero points of the same shape (8 when absent: the symmetric form,
  Q4_0's information content; GPTQ/AWQ checkpoints carry them): ``W = s (q - z)``.
  Activations are quantized per row and block of 32 inputs to int8
  (``rint(x * 127 / max|x|)``, fp32, as llama.cpp's Q8_0 does) and summed against the
  codes, so the op is a 4-bit-weight, 8-bit-activation product.
* ``w8a8`` — int8 weights ``[N, K]`` with one scale per output channel (as ``w8``)
  times 8-bit activations quantized per row over the row's range, with a zero point
  (:func:`quantize_w8a8_rows`): integer sums, scaled once. The models quantize its
  weights with :func:`quantize_w8a8` (an encoder's codes within [-64, 64]: see
  :data:`W8A8_FAST_LEVELS`); the op takes any int8 weights.

    codes, scales, zeros = quantize_w4(w)                     # symmetric: zeros None
    y, = Builder().build_operation("Linear", {"quant": "w4"}).execute(
        [x, codes, None, scales])
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InputError, ShapeError
from .base import f64

__all__ = ["quantize_w4", "dequantize_w4", "w4_groups", "ACT_BLOCK", "W4_GROUP",
           "quantize_w8a8", "W8A8_FAST_LEVELS", "W8A8_CLIPS", "quantize_w8a8_rows",
           "quantize_act_rows", "act_q8", "ref_w4", "ref_w8a8", "dense_or_w8_only"]

ACT_BLOCK = 32  # inputs per int8 activation block of w4 (a group is a multiple of it)
W4_GROUP = 32   # the default group size of w4 weights
# w8a8 weight codes within [-64, 64] multiply 8-bit activation codes (u <= 255) with one
# VPMADDUBSW without saturating its int16 pair sums (2 x 255 x 64 = 32640): the AVX2
# int8 product with no sign trick, ~1.3x the one for full-range codes. Encoders take it
# (MiniLM's embeddings lose little); decoders keep 127 levels (their logits lose more)
W8A8_FAST_LEVELS = 64
# fractions of max|w| tried as the clipping point of a row; the one of least squared
# error is kept (it wins back much of the accuracy of the lost bit)
W8A8_CLIPS = (1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.82, 0.8)


def w4_groups(k: int, group: int) -> int:
    """Scale columns of a w4 weight of ``k`` inputs: ``ceil(k / group)``."""
    return -(-k // group)


def _check_group(op: str, group: Any) -> None:
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or group < ACT_BLOCK \
            or group % ACT_BLOCK:
        raise InputError(op, "group_size", f"a multiple of {ACT_BLOCK}", repr(group))


def check_quant_weight(name: str, shape: tuple, finite: bool) -> None:
    """A weight quantizer's input check (``shape`` and whether every value is finite):
    rank 2 ``[out, in]`` with at least one input, and no NaN or inf, which would give a
    NaN or inf scale and codes that mean nothing. Raises the AtbError naming ``name``."""
    if len(shape) != 2 or shape[1] == 0:
        raise ShapeError(name, "weight shape", "rank 2 [out, in] with in >= 1",
                         f"shape {list(shape)}")
    if not finite:
        raise InputError(name, "weight values", "finite numbers", "a NaN or inf value")


def _quant_weight(name: str, weight: Any) -> np.ndarray:
    """``weight`` as the fp32 array the NumPy quantizers work on, checked."""
    w = np.asarray(weight).astype(np.float32)
    check_quant_weight(name, w.shape, w.ndim != 2 or bool(np.isfinite(w).all()))
    return w


def quantize_w4(weight: Any, group: int = W4_GROUP, symmetric: bool = True
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``weight`` [N, K] (any float array) as ``(codes uint8 [N, K], scales fp16
    [N, G], zeros uint8 [N, G] or None)``, ``G = ceil(K / group)``. Symmetric (Q4_0's
    rule): ``s = m / -8`` for the group's value ``m`` of largest magnitude, ``q =
    clip(rint(w / s) + 8, 0, 15)``; asymmetric: ``s = (max - min) / 15`` (the range
    holding 0), ``z = clip(rint(-min / s), 0, 15)``, ``q = clip(rint(w / s) + z, 0, 15)``.
    Scales are rounded to fp16 before the codes are chosen; fp32 arithmetic."""
    w = _quant_weight("quantize_w4", weight)
    _check_group("quantize_w4", group)
    n, k = w.shape
    kg = w4_groups(k, group) * group
    wf = np.zeros((n, kg), np.float32)
    wf[:, :k] = w
    g = wf.reshape(n, kg // group, group)                        # [N, G, group]
    with np.errstate(divide="ignore"):
        if symmetric:
            idx = np.abs(g).argmax(axis=-1)[..., None]
            m = np.take_along_axis(g, idx, -1)[..., 0]
            s = (m / np.float32(-8.0)).astype(np.float16)
            sf = s.astype(np.float32)[..., None]
            inv = np.where(sf != 0, np.float32(1.0) / sf, np.float32(0)).astype(np.float32)
            q = np.clip(np.rint(g * inv) + 8, 0, 15)
            zeros = None
        else:
            lo = np.minimum(g.min(axis=-1), 0).astype(np.float32)
            hi = np.maximum(g.max(axis=-1), 0).astype(np.float32)
            s = ((hi - lo) / np.float32(15.0)).astype(np.float16)
            sf = s.astype(np.float32)
            inv = np.where(sf != 0, np.float32(1.0) / sf, np.float32(0)).astype(np.float32)
            z = np.clip(np.rint(-lo * inv), 0, 15)
            q = np.clip(np.rint(g * inv[..., None]) + z[..., None], 0, 15)
            zeros = z.astype(np.uint8)
    codes = q.reshape(n, kg)[:, :k].astype(np.uint8)
    return np.ascontiguousarray(codes), s, zeros


def quantize_w8a8(weight: Any, levels: int = 127, clips: tuple = W8A8_CLIPS,
                  scale_dtype: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """``weight`` [N, K] as w8a8 weights ``(codes int8 [N, K], scale fp32 [N])``,
    ``W ~= codes * scale``: per output row ``scale = c max|w| / levels`` for the clip
    fraction ``c`` in ``clips`` of least squared error, ``codes = clip(rint(w / scale),
    -levels, levels)`` (fp32 arithmetic; a zero row gets scale 1). ``scale_dtype``
    (e.g. ``np.float16``) rounds the scales to that dtype before the codes are chosen.

        wq, s = quantize_w8a8(w, W8A8_FAST_LEVELS)    # |wq| <= 64
        y, = Builder().build_operation("Linear", {"quant": "w8a8"}).execute([x, wq, s])
    """
    w = _quant_weight("quantize_w8a8", weight)
    if isinstance(levels, bool) or not isinstance(levels, (int, np.integer)) \
            or not 1 <= levels <= 127:
        raise InputError("quantize_w8a8", "levels", "an int in [1, 127]", repr(levels))
    if not isinstance(clips, (tuple, list)) or not clips or not all(
            isinstance(c, (int, float, np.floating)) and not isinstance(c, bool) and 0 < c <= 1
            for c in clips):
        raise InputError("quantize_w8a8", "clips", "a non-empty sequence of fractions in (0, 1]",
                         repr(clips))
    amax = np.abs(w).max(axis=1)
    best_q = best_s = best_e = None
    for c in clips:
        s = np.where(amax > 0, amax * np.float32(c) / np.float32(levels), 1.0)
        s = s.astype(np.float32 if scale_dtype is None else scale_dtype).astype(np.float32)
        q = np.clip(np.rint(w / s[:, None]), -levels, levels)
        e = np.square(q * s[:, None] - w).sum(axis=1)
        if best_e is None:
            best_q, best_s, best_e = q, s, e
            continue
        better = e < best_e
        best_q = np.where(better[:, None], q, best_q)
        best_s, best_e = np.where(better, s, best_s), np.minimum(e, best_e)
    return best_q.astype(np.int8), best_s.astype(np.float32)


def dequantize_w4(codes: Any, scales: Any, zeros: Any = None, group: int = W4_GROUP
                  ) -> np.ndarray:
    """The float64 weight ``[N, K]`` of w4 ``codes`` ``[N, K]``: ``s (q - z)``."""
    q = f64(codes)
    k = q.shape[1]
    s = np.repeat(f64(scales), group, axis=1)[:, :k]
    z = 8.0 if zeros is None else np.repeat(f64(zeros), group, axis=1)[:, :k]
    return (q - z) * s


def _rows(name: str, x: Any) -> np.ndarray:
    """``x`` as the fp32 rows [M, K] (K >= 1) a row quantizer works on, checked."""
    xf = np.asarray(x).astype(np.float32)
    if xf.ndim != 2 or xf.shape[1] == 0:
        raise ShapeError(name, "x shape", "rank 2 [rows, in] with in >= 1",
                         f"shape {list(xf.shape)}")
    return xf


def quantize_act_rows(x: Any, block: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``x`` [M, K] as the C kernels quantize them (fp32 arithmetic):
    ``(q int8 [M, K'], dx fp32 [M, K' / block])`` per ``block`` inputs (None: the whole
    row, K' = K; else K' = K rounded up to ``block``, zeros past K), with
    ``dx = max|x| / 127`` and ``q = rint(x * (127 / max|x|))``."""
    xf = _rows("quantize_act_rows", x)
    if block is not None and (isinstance(block, bool) or not isinstance(block, (int, np.integer))
                              or block < 1):
        raise InputError("quantize_act_rows", "block", "None or an int >= 1", repr(block))
    m, k = xf.shape
    b = k if block is None else block
    kp = -(-k // b) * b
    xp = np.zeros((m, kp), np.float32)
    xp[:, :k] = xf
    blocks = xp.reshape(m, kp // b, b)
    amax = np.abs(blocks).max(axis=-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint((blocks * inv[..., None]).astype(np.float32)), -127, 127)
    return q.reshape(m, kp).astype(np.int8), (amax / np.float32(127)).astype(np.float32)


def act_q8(x: Any) -> np.ndarray:
    """float64 ``x`` [..., K] as the w8 kernels read it: each row in int8 blocks of
    :data:`ACT_BLOCK` inputs (:func:`quantize_act_rows`), dequantized."""
    xa = np.asarray(x)
    k = xa.shape[-1]
    q, dx = quantize_act_rows(xa.reshape(-1, k), ACT_BLOCK)        # [M, K'], [M, K'/32]
    xq = (f64(q).reshape(q.shape[0], -1, ACT_BLOCK) * f64(dx)[..., None]).reshape(q.shape)
    return xq[:, :k].reshape(xa.shape)


def ref_w4(x: Any, codes: Any, scales: Any, zeros: Any, group: int) -> np.ndarray:
    """float64 ``quant32(x) @ W.T`` of a w4 weight, ``x`` [..., K] (see the module doc)."""
    xa = np.asarray(x)
    k = xa.shape[-1]
    q, dx = quantize_act_rows(xa.reshape(-1, k), ACT_BLOCK)        # [M, K'], [M, K'/32]
    xq = (f64(q).reshape(q.shape[0], -1, ACT_BLOCK) * f64(dx)[..., None]).reshape(q.shape)
    w = dequantize_w4(codes, scales, zeros, group)                 # [N, K]
    y = xq[:, :k] @ w.T
    return y.reshape(*xa.shape[:-1], w.shape[0])


def quantize_w8a8_rows(x: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of ``x`` [M, K] as the w8a8 kernels quantize them (fp32 arithmetic): ``(u
    uint8 [M, K], sx fp32 [M], z int32 [M])`` with ``x ~= (u - z) sx``. The row's range
    ``[lo, hi] = [min(0, min x), max(0, max x)]`` takes the codes 1..255: ``sx = (hi -
    lo) / 254``, ``inv = 254 / (hi - lo)``, ``z = 1 - rint(lo inv)``, ``u = clip(rint(x
    inv) + z, 1, 255)``; a row of zeros gets ``sx = 0, z = 128``. A skewed row (a GELU's
    output) so gets about twice the resolution of a symmetric ``max|x| / 127``."""
    xf = _rows("quantize_w8a8_rows", x)
    lo = np.minimum(xf.min(axis=1), 0).astype(np.float32)
    hi = np.maximum(xf.max(axis=1), 0).astype(np.float32)
    rng = (hi - lo).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(rng > 0, np.float32(254) / rng, np.float32(0)).astype(np.float32)
    z = np.where(rng > 0, 1 - np.rint(lo * inv), 128).astype(np.int32)
    u = np.clip(np.rint((xf * inv[:, None]).astype(np.float32)) + z[:, None], 1, 255)
    return u.astype(np.uint8), (rng / np.float32(254)).astype(np.float32), z


def ref_w8a8(x: Any, w_int8: Any, scale: Any) -> np.ndarray:
    """float64 ``((u - z) @ w.T) * sx * scale`` of per-row 8-bit activations
    (:func:`quantize_w8a8_rows`) and int8 weights."""
    xa = np.asarray(x)
    k = xa.shape[-1]
    u, sx, z = quantize_w8a8_rows(xa.reshape(-1, k))               # [M, K], [M], [M]
    q = u.astype(np.int64) - z[:, None]
    acc = q @ np.asarray(w_int8).astype(np.int64).T                # exact integer sums
    y = f64(acc) * f64(sx)[:, None] * f64(scale)[None, :]
    return y.reshape(*xa.shape[:-1], acc.shape[1])


def dense_or_w8_only(p: Any, ins: Any = None) -> list[str]:
    """A kernel check (``Kernel.check``) for kernels that compute float and w8 weights
    only: the reason they cannot run a ``w4`` / ``w8a8`` call (empty list otherwise)."""
    q = getattr(p, "quant", None)
    if q in ("w4", "w8a8"):
        return [f"quant={q!r}: this kernel computes float and w8 weights only"]
    return []
