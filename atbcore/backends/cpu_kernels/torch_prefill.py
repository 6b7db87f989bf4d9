"""The C prefill attention on torch CPU tensors: many query rows per sequence, causal
(or windowed, or full) over the sequence's own keys, for packed variable-length
sequences or a padded batch (``csrc/flash.c``). One C call for every sequence and
head; the work splits over the C pool, so callers that run it among torch ops
need nothing parked (it is one call between GEMMs).
"""

from __future__ import annotations

import ctypes
import struct
from typing import Sequence

import torch

from atbcore.errors import ParamsError, ShapeError

from . import torch_checks as chk
from .threads import pool_threads
from .torch_decode import _attention_dtypes
from .torch_ops import DTYPE_CODES, _check, _fn

__all__ = ["prefill_attention", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256  # FL_MAX_D in flash.c
_FLASH = struct.Struct("<23qd")


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                      q_lens: Sequence[int] | None = None, kv_lens: Sequence[int] | None = None,
                      causal: bool = True, window: int | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q`` over ``k``/``v`` per sequence, in one C call.

    Packed (3-D): ``q`` [T, H, D], ``k``/``v`` [Tk, KV, D]; ``q_lens`` and ``kv_lens``
    (default ``q_lens``) split the tokens into sequences. Padded batch (4-D): ``q``
    [B, Sq, H, D], ``k``/``v`` [B, Skv, KV, D]; ``kv_lens`` (default Skv for every
    row) are each row's valid keys. Any strides with D unit-stride. Positions are
    bottom-right aligned per sequence (query i at ``max(L - Sq, 0) + i``); with
    ``causal`` key j is seen when ``j <= pos``, with ``window`` also when
    ``j > pos - window``; a row that sees no key gives zeros. fp32 scores, softmax
    and sums, one rounding into ``out`` (a new tensor in q's dtype and shape when
    None)."""
    op = "prefill_attention"
    chk.tensor(op, "q", q, dims=(3, 4))
    chk.tensor(op, "k", k)
    chk.tensor(op, "v", v)
    scale = chk.real(op, "scale", scale, finite=False)
    chk.output(op, "out", out, q.shape)
    if window is not None:
        window = chk.integer(op, "window", window)
        if window < 1:
            raise ShapeError(op, "window", "a positive int or None", repr(window))
    if q.dim() not in (3, 4) or k.dim() != q.dim() or v.shape != k.shape:
        raise ShapeError(op, "q / k / v shapes", "q [T, H, D] with k, v [Tk, KV, D], or "
                         "q [B, Sq, H, D] with k, v [B, Skv, KV, D]",
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    h, d, kv = q.shape[-2], q.shape[-1], k.shape[-2]
    if k.shape[-1] != d or kv == 0 or h % kv or d > MAX_HEAD_DIM:
        raise ShapeError(op, "heads", f"the same head_dim (<= {MAX_HEAD_DIM}) and query heads "
                         "a multiple of KV heads", f"q {tuple(q.shape)}, k {tuple(k.shape)}")
    _attention_dtypes(op, (("q", q), ("k", k), ("v", v)))
    if window is not None and window > min(max(k.shape[-3], q.shape[-3]), chk.INT32_MAX):
        window = None  # the kernel's positions are int32; a window past every key is causal
        causal = True
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype)
    if out.shape != q.shape or out.dtype not in DTYPE_CODES:
        raise ShapeError(op, "out", f"{tuple(q.shape)} fp32/bf16/fp16",
                         f"{tuple(out.shape)} {out.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.stride(-1) != 1:
            raise ShapeError(op, name, "a unit-stride last dim", f"strides {t.stride()}")
    seqs = _sequences(op, q, k, v, out, q_lens, kv_lens)
    if q.numel() == 0:
        return out
    if window is not None:
        causal = True  # a window implies causal (positions are bottom-right aligned)
    args = _FLASH.pack(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                       DTYPE_CODES[q.dtype], DTYPE_CODES[k.dtype], DTYPE_CODES[out.dtype],
                       h, kv, d, q.stride(-3), q.stride(-2), k.stride(-3), k.stride(-2),
                       v.stride(-3), v.stride(-2), out.stride(-3), out.stride(-2),
                       len(seqs) // 6, ctypes.addressof(seqs), int(causal), int(window or 0),
                       pool_threads(), float(scale))
    _check(_fn("prefill_attention")(args), op)
    return out


def _sequences(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               q_lens: Sequence[int] | None, kv_lens: Sequence[int] | None) -> ctypes.Array:
    """int64 [S * 6]: each sequence's element offsets into q, k, v, out and its query
    and key counts (checked against the tensors: no read or write outside them). A
    ctypes array, so building it dispatches no torch op."""
    if q.dim() == 4:
        b, sq, skv = q.shape[0], q.shape[1], k.shape[1]
        if k.shape[0] != b:
            raise ShapeError(op, "k batch", b, k.shape[0])
        if q_lens is not None:
            raise ShapeError(op, "q_lens", "None for a padded [B, Sq, H, D] batch", "given")
        lens = [skv] * b if kv_lens is None else _ints(op, "kv_lens", kv_lens)
        if len(lens) != b or any(not 0 <= n <= skv for n in lens):
            raise ShapeError(op, "kv_lens", f"{b} values in 0..{skv}", list(lens))
        rows = [(i * q.stride(0), i * k.stride(0), i * v.stride(0), i * out.stride(0), sq, n)
                for i, n in enumerate(lens)]
        return _flat(rows)
    if q_lens is None:
        raise ShapeError(op, "q_lens", "the query tokens of each packed sequence", "None")
    ql = _ints(op, "q_lens", q_lens)
    kl = ql if kv_lens is None else _ints(op, "kv_lens", kv_lens)
    if (len(kl) != len(ql) or any(n < 0 for n in ql + kl) or sum(ql) != q.shape[0]
            or sum(kl) != k.shape[0]):
        raise ShapeError(op, "q_lens / kv_lens", f"non-negative counts summing to {q.shape[0]} "
                         f"queries and {k.shape[0]} keys", f"{ql}, {kl}")
    rows, a, c = [], 0, 0
    for nq, nk in zip(ql, kl):
        rows.append((a * q.stride(0), c * k.stride(0), c * v.stride(0), a * out.stride(0), nq, nk))
        a, c = a + nq, c + nk
    return _flat(rows)


def _ints(op: str, name: str, seq: Sequence[int]) -> list[int]:
    try:
        vals = list(seq)
    except TypeError:
        raise ParamsError(op, name, "a sequence of ints", repr(seq)) from None
    out = [chk.integer(op, name, n) for n in vals]
    if any(not 0 <= n <= chk.INT32_MAX for n in out):
        raise ShapeError(op, name, f"counts in [0, {chk.INT32_MAX}]", out)
    return out


def _flat(rows: list) -> ctypes.Array:
    return (ctypes.c_int64 * (6 * len(rows)))(*(x for r in rows for x in r))
