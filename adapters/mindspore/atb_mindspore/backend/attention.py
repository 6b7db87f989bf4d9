"""MindSpore kernel of FlashAttention: query-chunked softmax attention with GQA,
bottom-right aligned causal / sliding-window masks, given masks and per-batch kv
lengths (decode over a KV cache), computed in fp32 and rounded once.

Memory stays O(N): queries go ``CHUNK`` rows at a time, each chunk over only the
key range it can reach, so neither the scores nor a mask of ``[Sq, Skv]`` is ever
built whole. GQA never copies k/v: q heads are grouped ``[B, Hkv, G*c, D]`` against
their shared kv head. On Ascend, fp16/bf16 calls without a given mask, kv lengths
or window use the fused ``ops.flash_attention_score`` (causal as sparse mode 3,
right-down aligned like atb); it is not registered on the CPU.
"""

from __future__ import annotations

from typing import Any

from atbcore.ops.attention import AttnDims, attention_dims, split_packed

from . import kernel
from .common import NEG_INF, arange, cast, descs, f32, mint, ms, note, on_ascend, ops, swap_last

__all__ = ["attention_bnsd", "to_bnsd", "from_bnsd", "CHUNK", "attention_run"]

CHUNK = 512


def to_bnsd(x: Any, layout: str, heads: int) -> Any:
    """``x`` in ``layout`` as ``[B, N, S, D]``."""
    if layout == "BNSD":
        return x
    if layout == "BSH":
        b, s, hid = x.shape
        x = x.reshape((b, s, heads, hid // heads))
    return mint().transpose(x, 1, 2)                          # [B, S, N, D] -> [B, N, S, D]


def from_bnsd(o: Any, layout: str) -> Any:
    """``o`` [B, N, S, D] back into ``layout``."""
    if layout == "BNSD":
        return o
    o = mint().transpose(o, 1, 2)                             # [B, N, S, D] -> [B, S, N, D]
    return o.reshape((o.shape[0], o.shape[1], -1)) if layout == "BSH" else o


def _group_mask(mc: Any, hkv: int, g: int) -> Any:
    """A mask chunk [B|1, H|1, c|1, K|1] as [B|1, Hkv|1, G|1, c|1, K|1]."""
    b, h, c, k = mc.shape
    return mc.reshape((b, hkv, g, c, k)) if h != 1 else mc.reshape((b, 1, 1, c, k))


def attention_bnsd(q: Any, k: Any, v: Any, *, scale: float, causal: bool,
                   window: int | None = None, mask: Any = None, kv_lens: list[int] | None = None,
                   chunk: int = CHUNK) -> Any:
    """fp32 attention of q ``[B, H, Sq, D]`` over k/v ``[B, Hkv, Skv, D]`` with the
    semantics of :mod:`atbcore.ops.attention`; returns fp32 ``[B, H, Sq, D]``."""
    mt, m, op = mint(), ms(), ops()
    b_, h, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    g = h // hkv
    causal = causal or window is not None
    lens = [skv] * b_ if kv_lens is None else [int(n) for n in kv_lens]
    need_mask = causal or kv_lens is not None
    q5 = q.reshape((b_, hkv, g, sq, d))                       # q head = kv head * G + i
    kt = swap_last(k)                                         # [B, Hkv, D, Skv]
    m4 = None
    if mask is not None:
        m4 = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
        m4 = m4 if m4.dtype == m.bool_ else f32(m4)
    lens_t = m.Tensor(lens, m.int64).reshape((b_, 1, 1))
    offs_t = m.Tensor([max(n - sq, 0) for n in lens], m.int64).reshape((b_, 1))
    outs = []
    for r0 in range(0, sq, chunk):
        r1 = min(sq, r0 + chunk)
        c = r1 - r0
        # the key range [lo, hi) any row of this chunk can reach, over the batch
        hi = max(min(n, max(n - sq, 0) + r1) if causal else n for n in lens)
        lo = max(0, min(max(n - sq, 0) + r0 - window + 1 for n in lens)) if window else 0
        if hi <= lo:
            outs.append(m.ops.zeros((b_, h, c, d), m.float32))
            continue
        kk = hi - lo
        qc = q5[:, :, :, r0:r1].reshape((b_, hkv, g * c, d))
        s = mt.matmul(qc, kt[..., lo:hi]).reshape((b_, hkv, g, c, kk))
        s = mt.mul(s, float(scale))                          # [B, Hkv, G, c, K]
        allow = None
        if need_mask:
            keys = arange(lo, hi).reshape((1, 1, kk))
            allow = mt.lt(keys, lens_t)                      # [B, 1, K]
            if causal:
                pos = mt.add(offs_t, arange(r0, r1).reshape((1, c))).reshape((b_, c, 1))
                allow = mt.logical_and(allow, mt.le(keys, pos))              # [B, c, K]
                if window is not None:
                    allow = mt.logical_and(allow, mt.gt(keys, mt.sub(pos, int(window))))
            allow = allow.reshape((b_, 1, 1, allow.shape[1], kk))
        if m4 is not None:
            mc = m4[:, :, r0:r1] if m4.shape[2] != 1 else m4
            mc = _group_mask(mc[..., lo:hi] if mc.shape[3] != 1 else mc, hkv, g)
            if mc.dtype == m.bool_:
                allow = mc if allow is None else mt.logical_and(allow, mc)
            else:
                s = mt.add(s, mc)
        if allow is not None:
            s = op.masked_fill(s, mt.logical_not(allow), NEG_INF)
        mx = mt.amax(s, -1, True)
        empty = mt.isinf(mx)                                # a row that sees no key
        mx = op.masked_fill(mx, empty, 0.0)
        e = mt.exp(mt.sub(s, mx))
        den = op.masked_fill(mt.sum(e, -1, True), empty, 1.0)
        pr = mt.div(e, den).reshape((b_, hkv, g * c, kk))
        o = mt.matmul(pr, v[:, :, lo:hi])                    # [B, Hkv, G*c, D]
        outs.append(o.reshape((b_, h, c, d)))
    return outs[0] if len(outs) == 1 else mt.cat(outs, 2)


def _fused_reason(p: Any, ins: dict, dims: AttnDims) -> str:
    q = ins["q"]
    if not on_ascend(q):
        return "ops.flash_attention_score is Ascend-only"
    if str(q.dtype) not in ("Float16", "BFloat16"):
        return "ops.flash_attention_score takes fp16/bf16"
    if ins.get("mask") is not None or ins.get("seq_lens") is not None or p.window is not None:
        return "a given mask, seq_lens or a window"
    if dims.head_dim % 16:
        return f"head_dim {dims.head_dim} is not a multiple of 16"
    if p.causal and dims.q_len > dims.kv_len:  # sparse mode 3 aligns rows bottom-right
        return f"causal with Sq {dims.q_len} > Skv {dims.kv_len} (rows sit top-left then)"
    if dims.heads > 256 or dims.head_dim > 768:
        return "ops.flash_attention_score takes N <= 256 and D <= 768"
    return ""


def _fused(p: Any, q: Any, k: Any, v: Any, dims: AttnDims) -> Any:
    m = ms()
    scale = p.scale if p.scale is not None else dims.scale_default
    kw: dict[str, Any] = {"input_layout": "BNSD", "scalar_value": float(scale)}
    if p.causal:  # sparse mode 3: right-down causal over a compressed 2048 x 2048 mask
        kw["attn_mask"] = mint().triu(m.ops.ones((2048, 2048), m.uint8), 1)
        kw["sparse_mode"] = 3
    return ops().flash_attention_score(q, k, v, dims.heads, **kw)


def attention_run(p: Any, ins: dict, op: str = "FlashAttention") -> Any:
    """The FlashAttention op on MindSpore tensors (``p``: FlashAttentionParams)."""
    dims = attention_dims(op, p, descs(ins))
    q, k, v = ins["q"], ins["k"], ins["v"]
    if dims.packed:
        q, k, v = split_packed(q, dims)
    qb = to_bnsd(q, dims.layout, dims.heads)
    kb, vb = to_bnsd(k, dims.layout, dims.kv_heads), to_bnsd(v, dims.layout, dims.kv_heads)
    why = _fused_reason(p, ins, dims)
    if not why:
        note(op, "ops.flash_attention_score (Ascend fused)")
        return from_bnsd(_fused(p, qb.contiguous(), kb.contiguous(), vb.contiguous(), dims),
                         dims.layout)
    note(op, "chunked softmax attention, fp32", why)
    lens = ins.get("seq_lens")
    o = attention_bnsd(f32(qb), f32(kb), f32(vb),
                       scale=p.scale if p.scale is not None else dims.scale_default,
                       causal=p.causal, window=p.window, mask=ins.get("mask"),
                       kv_lens=None if lens is None else [int(x) for x in
                                                         lens.asnumpy().reshape(-1).tolist()])
    return cast(from_bnsd(o, dims.layout), ins["q"].dtype)


@kernel("FlashAttention", impl="mindspore chunked softmax attention (fp32 compute; "
        "Ascend: ops.flash_attention_score)", launches=6)
def flash_attention(p, ins):
    return [attention_run(p, ins).contiguous()]
