"""One key chunk of flash attention's online softmax, shared by the Triton prefill
kernels (contiguous and paged caches): the kernels differ only in how they address K/V.

``allow`` [BLOCK_M, BLOCK_N] says which (row, key) pairs count (key in range, row in
range, causal, window); scores are folded into exp2 space by ``scale_log2``. Rows that
have seen no key yet keep ``m = -inf`` and add nothing (their exp2 is taken against 0).
``IEEE`` forces fp32 dots at IEEE precision (the interpreter's and the tests' path)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["online_softmax_chunk"]


@triton.jit
def online_softmax_chunk(q, k, v, allow, scale_log2, m, l_sum, acc, IEEE: tl.constexpr):
    """``(m, l_sum, acc)`` after one chunk of keys ``k`` and values ``v``."""
    if IEEE:
        sc = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        sc = tl.dot(q, tl.trans(k))
    sc = tl.where(allow, sc * scale_log2, float("-inf"))              # [BLOCK_M, BLOCK_N]
    m_new = tl.maximum(m, tl.max(sc, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)           # rows with no key yet
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(sc - m_safe[:, None])
    l_sum = l_sum * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_sum, acc
