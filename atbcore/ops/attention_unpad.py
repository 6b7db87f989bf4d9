"""``UnpadFlashAttention``: attention over packed variable-length sequences (ATB's
unpadded self-attention, what encoders run: no padding token is ever computed).

    op = Builder().build_operation("UnpadFlashAttention", {"num_heads": 12})
    out, = op.execute([qkv, seq_lens])   # qkv [T, (H + 2*Hkv)*D], seq_lens [B] -> [T, H*D]

* ``qkv``: the ``T = sum(seq_lens)`` tokens of ``B`` sequences, packed one sequence
  after the other (row-major), each token's q heads, then its k heads, then its v
  heads (a merged QKV Linear's output).
* ``seq_lens``: int32/int64 ``[B]``, each sequence's token count (0 allowed: an empty
  sequence has no rows). A token attends to the keys of its own sequence only:
  every one of them, or with ``causal`` those at or before it.
* GQA as FlashAttention (q head h reads kv head ``h // (H / Hkv)``); ``scale``
  None means ``1/sqrt(D)``.

The NumPy reference runs :func:`~atbcore.ops.attention.ref_attention` per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import DtypeError, InputError, ShapeError
from ..tensor import TensorDesc
from .attention import INT_DTYPES, host_ints, ref_attention, validate_head_params
from .base import FLOAT_DTYPES, OpDef, Params, expect_dtype, expect_rank
from .registry import register_op

__all__ = ["UnpadFlashAttentionParams", "unpad_geometry"]


@dataclass(frozen=True)
class UnpadFlashAttentionParams(Params):
    """``num_heads`` (required), ``num_kv_heads`` (None = num_heads), ``head_dim``
    (None = inferred from qkv's width), ``scale`` (None = 1/sqrt(head_dim)),
    ``causal``."""

    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    scale: float | None = None
    causal: bool = False
    window: int | None = None  # only None: the field keeps the shared head checks whole

    def validate(self) -> None:
        validate_head_params(self)
        if self.num_heads is None:
            self.fail("num_heads", "a positive int", "None")
        if self.window is not None:
            self.fail("window", "None (no sliding window over packed sequences)", self.window)


def unpad_geometry(op: str, p: UnpadFlashAttentionParams, qkv: TensorDesc,
                   lens: TensorDesc) -> tuple[int, int, int]:
    """(heads, kv_heads, head_dim) of a call; checks ranks, dtypes and widths."""
    expect_rank(op, "qkv", qkv, 2)
    expect_dtype(op, "qkv", qkv, FLOAT_DTYPES)
    if lens.dtype not in INT_DTYPES:
        raise DtypeError(op, "input 'seq_lens' dtype", "INT32/INT64", lens.dtype.name)
    expect_rank(op, "seq_lens", lens, 1)
    h = int(p.num_heads)
    hkv = int(p.num_kv_heads or h)
    width = qkv.shape[1]
    if width == 0 or width % (h + 2 * hkv):
        raise ShapeError(op, "input 'qkv' width ((num_heads + 2*num_kv_heads) * head_dim)",
                         f"a positive multiple of {h + 2 * hkv}", width)
    d = width // (h + 2 * hkv)
    if p.head_dim is not None and p.head_dim != d:
        raise ShapeError(op, "input 'qkv' head_dim (params head_dim)", p.head_dim, d)
    return h, hkv, d


@register_op
class UnpadFlashAttention(OpDef):
    """Attention of packed variable-length sequences; see the module docstring."""

    name = "UnpadFlashAttention"
    aliases = ("UnpadSelfAttention",)
    Params = UnpadFlashAttentionParams
    inputs = ("qkv", "seq_lens")
    outputs = ("out",)

    def infer_shape(self, p, ins):
        qkv, lens = ins["qkv"], ins["seq_lens"]
        h, _, d = unpad_geometry(self.name, p, qkv, lens)
        return [TensorDesc((qkv.shape[0], h * d), qkv.dtype)]

    def check_values(self, p, ins):
        lens = host_ints(ins["seq_lens"])
        t = int(TensorDesc.of(ins["qkv"]).shape[0])
        if (lens < 0).any() or int(lens.sum()) != t:
            raise InputError(self.name, "input 'seq_lens' values",
                             f"non-negative counts summing to the {t} tokens of qkv",
                             lens.tolist())

    def reference(self, p, ins):
        qkv, lens = np.asarray(ins["qkv"]), host_ints(ins["seq_lens"])
        h, hkv, d = unpad_geometry(self.name, p, TensorDesc.of(qkv), TensorDesc.of(ins["seq_lens"]))
        scale = p.scale if p.scale is not None else 1.0 / float(np.sqrt(d))
        out = np.zeros((qkv.shape[0], h * d))
        start = 0
        for n in lens.tolist():
            rows = qkv[start:start + n]                                  # [n, (H + 2Hkv) * D]

            def heads(a: np.ndarray, k: int) -> np.ndarray:              # [n, k*D] -> [1, k, n, D]
                return a.reshape(n, k, d).transpose(1, 0, 2)[None]
            q = heads(rows[:, :h * d], h)
            k = heads(rows[:, h * d:(h + hkv) * d], hkv)
            v = heads(rows[:, (h + hkv) * d:], hkv)
            if n:
                o = ref_attention(q, k, v, scale=scale, causal=p.causal)  # [1, H, n, D]
                out[start:start + n] = o[0].transpose(1, 0, 2).reshape(n, h * d)
            start += n
        return [out.astype(qkv.dtype)]

