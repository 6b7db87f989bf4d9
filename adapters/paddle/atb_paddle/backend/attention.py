"""Paddle kernel of FlashAttention (causal, sliding window, GQA, masks, per-batch kv
lengths, decode against a KV cache with bottom-right aligned rows).

Two paths, both in fp32 with one rounding at the end:

* no mask to build (no mask / seq_lens / window; causal only when Sq == Skv or
  Sq == 1): ``paddle.nn.functional.scaled_dot_product_attention`` on ``[B, S, H, D]``
  (on a GPU, fp16/bf16 inputs go in as they are and Paddle picks FlashAttention;
  on the CPU it runs its "math" path, which holds ``[B, H, Sq, Skv]`` scores, so
  there it is used only up to ``CHUNK`` query rows);
* otherwise queries are processed ``CHUNK`` rows at a time, each chunk over only the
  key range it can reach, as grouped matmuls (``[B, Hkv, G*c, D] @ [B, Hkv, D, K]``,
  no repeated k/v), so memory stays linear in the sequence length.

Rows that see no key give zeros (the op's contract).
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F

from atbcore.ops.attention import attention_dims, split_packed
from atbcore.tensor import describe

from . import kernel
from .common import HALF, PATHS, device_kind, f32, to_dtype

__all__ = ["attention_bnsd", "no_mask_needed", "to_bnsd", "from_bnsd", "CHUNK"]

# Query rows per step when scores are computed here: [B, H, CHUNK, Skv] fp32 scores.
CHUNK = 256


def to_bnsd(x, layout: str, heads: int):
    """``x`` in ``layout`` as ``[B, N, S, D]``."""
    if layout == "BNSD":
        return x
    if layout == "BSH":
        b, s, hid = x.shape
        x = x.reshape([b, s, heads, hid // heads])
    return x.transpose([0, 2, 1, 3])                    # [B, S, N, D] -> [B, N, S, D]


def from_bnsd(o, layout: str):
    """``o`` [B, N, S, D] back into ``layout``."""
    if layout == "BNSD":
        return o
    o = o.transpose([0, 2, 1, 3])                       # [B, N, S, D] -> [B, S, N, D]
    return o.reshape([o.shape[0], o.shape[1], -1]) if layout == "BSH" else o


def _sdpa_whole(q, k, v, scale: float, causal: bool):
    """F.scaled_dot_product_attention on BNSD fp32 inputs (GQA by Paddle)."""
    sq, skv = q.shape[2], k.shape[2]
    t = lambda x: x.transpose([0, 2, 1, 3])             # noqa: E731  BNSD <-> BSND
    o = F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=causal and sq == skv > 1,
                                       training=False, scale=scale)
    return t(o)


def no_mask_needed(sq: int, skv: int, causal: bool, window, mask, kv_lens) -> bool:
    """True when SDPA's own ``is_causal`` (top-left aligned) covers the call."""
    return mask is None and kv_lens is None and window is None and (
        not causal or sq == 1 or sq == skv)


def attention_bnsd(q, k, v, *, scale: float, causal: bool, window: int | None = None,
                   mask=None, kv_lens=None, chunk: int | None = None):
    """fp32 attention of q ``[B, H, Sq, D]`` over k/v ``[B, Hkv, Skv, D]`` with the
    semantics of :mod:`atbcore.ops.attention`; returns fp32 ``[B, H, Sq, D]``.
    ``chunk``: query rows per step (default :data:`CHUNK`)."""
    chunk = chunk or CHUNK
    b_, h, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    g = h // hkv
    causal = causal or window is not None
    simple = no_mask_needed(sq, skv, causal, window, mask, kv_lens)
    if simple and (sq <= chunk or device_kind(q) != "cpu"):
        PATHS[("FlashAttention", "sdpa")] += 1
        return _sdpa_whole(q, k, v, scale, causal)
    PATHS[("FlashAttention", "chunked")] += 1
    lens = [skv] * b_ if kv_lens is None else [int(n) for n in kv_lens.numpy().tolist()]
    lens_t = paddle.to_tensor(lens, dtype="int64", place=q.place)
    offs_t = paddle.clip(lens_t - sq, min=0)            # row i of entry b sits at offs[b] + i
    m4 = None
    if mask is not None:
        m4 = mask.reshape([1] * (4 - mask.ndim) + list(mask.shape))
    qg = q.reshape([b_, hkv, g, sq, d])                 # q head h reads kv head h // g
    outs = []
    for r0 in range(0, sq, chunk):
        r1 = min(sq, r0 + chunk)
        c = r1 - r0
        # the key range [lo, hi) any row of this chunk can reach, over the batch
        hi = max(min(n, max(n - sq, 0) + r1) if causal else n for n in lens)
        lo = max(0, min(max(n - sq, 0) + r0 - window + 1 for n in lens)) if window else 0
        if hi <= lo:
            outs.append(paddle.zeros([b_, h, c, d], dtype=q.dtype))
            continue
        keys = paddle.arange(lo, hi, dtype="int64")
        pos = offs_t.unsqueeze(1) + paddle.arange(r0, r1, dtype="int64").unsqueeze(0)   # [B, c]
        allow = (keys.reshape([1, 1, -1]) < lens_t.reshape([-1, 1, 1]))              # [B, 1, K]
        allow = allow.expand([b_, c, hi - lo])
        if causal:
            allow = allow & (keys.reshape([1, 1, -1]) <= pos.unsqueeze(-1))
        if window is not None:
            allow = allow & (keys.reshape([1, 1, -1]) > pos.unsqueeze(-1) - window)
        allow = allow.unsqueeze(1)                                                   # [B, 1, c, K]
        qc = qg[:, :, :, r0:r1].reshape([b_, hkv, g * c, d])                         # [B, Hkv, G*c, D]
        s = paddle.matmul(qc, k[:, :, lo:hi], transpose_y=True) * scale              # [B, Hkv, G*c, K]
        s = s.reshape([b_, h, c, hi - lo])
        if m4 is not None:
            mc = m4[:, :, r0:r1] if m4.shape[2] != 1 else m4
            mc = mc[..., lo:hi] if mc.shape[3] != 1 else mc
            if mc.dtype == paddle.bool:
                allow = allow & mc
            else:
                s = s + f32(mc)
        allow = allow.expand(s.shape)
        s = paddle.where(allow, s, paddle.full([], float("-inf"), dtype=s.dtype))
        mx = s.max(axis=-1, keepdim=True)
        seen = paddle.isfinite(mx)
        e = paddle.exp(s - paddle.where(seen, mx, paddle.zeros_like(mx)))
        den = e.sum(axis=-1, keepdim=True)
        e = e / paddle.where(seen, den, paddle.ones_like(den))
        o = paddle.matmul(e.reshape([b_, hkv, g * c, hi - lo]), v[:, :, lo:hi])     # [B, Hkv, G*c, D]
        o = o.reshape([b_, h, c, d])
        outs.append(paddle.where(seen, o, paddle.zeros_like(o)))
    return outs[0] if len(outs) == 1 else paddle.concat(outs, axis=2)


@kernel("FlashAttention", impl="paddle scaled_dot_product_attention (fp32; flash on GPU), "
        "query-chunked grouped matmuls when a mask is built")
def flash_attention(p, ins):
    dims = attention_dims("FlashAttention", p, {n: None if x is None else describe(x)
                                                for n, x in ins.items()})
    q, k, v = ins["q"], ins["k"], ins["v"]
    if dims.packed:
        q, k, v = split_packed(q, dims)
    qb, kb, vb = (to_bnsd(t, dims.layout, h) for t, h in
                  ((q, dims.heads), (k, dims.kv_heads), (v, dims.kv_heads)))
    scale = p.scale if p.scale is not None else dims.scale_default
    if (q.dtype in HALF and device_kind(q) == "cuda" and
            no_mask_needed(dims.q_len, dims.kv_len, p.causal, p.window, ins.get("mask"),
                           ins.get("seq_lens"))):
        # GPU half: Paddle's flash attention (fp32 softmax inside, one rounding)
        PATHS[("FlashAttention", "sdpa")] += 1
        o = _sdpa_whole(qb, kb, vb, scale, p.causal)
    else:
        o = attention_bnsd(f32(qb), f32(kb), f32(vb), scale=scale, causal=p.causal,
                           window=p.window, mask=ins.get("mask"), kv_lens=ins.get("seq_lens"))
    return [to_dtype(from_bnsd(o, dims.layout), ins["q"].dtype).contiguous()]
