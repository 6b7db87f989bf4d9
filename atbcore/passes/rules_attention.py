"""Attention fusions, applied in this order by the pipeline:

1. ``attention``: ``MatMul(q, k, transpose_b)`` [``* scale`` (Elewise muls)] [``+ mask``]
   ``-> Softmax -> MatMul(p, v)`` on 4-D ``[B, N, S, D]`` tensors (or the same with
   ``ScaledMaskedSoftmax``) -> ``FlashAttention(q, k, v[, mask], layout="BNSD")``.
   A constant additive mask that is exactly the (bottom-right aligned) causal
   mask becomes ``causal=True`` with no mask tensor.
2. ``attention_bsnd``: ``Transpose(0,2,1,3)`` around a BNSD FlashAttention (on q, k,
   v and on the output) -> the same attention in BSND on the untransposed tensors.
3. ``attention_bsh``: ``Reshape([B,S,H*D] -> [B,S,N,D])`` around a BSND FlashAttention
   -> BSH on the un-reshaped tensors.
4. ``rope_attention``: ``RoPE(q, k) -> FlashAttention(q', k', v)`` ->
   ``RopeFlashAttention(q, k, v, ...)`` (one node; layouts must agree).
5. ``packed_qkv``: ``Split`` of one tensor into the q, k, v of a BSH attention ->
   attention on the packed tensor (no split copy).

Transposes and reshapes left without readers are removed by DCE afterwards.
"""

from __future__ import annotations

import numpy as np

from ..graph.analysis import bind_ids
from ..graph.ir import Node
from ..ops.registry import get_op
from .pattern import Alt, Match, Op, elewise, params_are
from .rewrite import Rewrite

__all__ = ["ATTENTION_PATTERN", "attention_rewrite", "BSND_PATTERN", "bsnd_rewrite",
           "BSH_PATTERN", "bsh_rewrite", "ROPE_ATTENTION_PATTERN", "rope_attention_rewrite",
           "PACKED_QKV_PATTERN", "packed_qkv_rewrite", "is_causal_mask"]

_QK = Op("MatMul", ("q", "k"), where=params_are(transpose_a=False, transpose_b=True), name="qk")
_SCALED = Op("Elewise", (_QK,), where=elewise("muls"), name="scale")
_SCORES = Alt(
    Op("Elewise", (_SCALED, "mask"), where=elewise("add"), commutative=True, name="mask_add"),
    Op("Elewise", (_QK, "mask"), where=elewise("add"), commutative=True, name="mask_add"),
    _SCALED, _QK)
_PROBS = Alt(Op("Softmax", (_SCORES,), name="softmax"),
             Op("ScaledMaskedSoftmax", (Alt(_SCALED, _QK), Alt("mask", None)), name="sms"))
ATTENTION_PATTERN = Op("MatMul", (_PROBS, "v"), where=params_are(transpose_a=False,
                                                                transpose_b=False), name="pv")


def is_causal_mask(mask: np.ndarray, sq: int, skv: int) -> bool:
    """True when an additive mask is 0 exactly where query i (at position
    ``skv - sq + i``) may see key j <= its position and very negative elsewhere."""
    m = np.asarray(mask, dtype=np.float64)
    if m.ndim < 2 or m.shape[-2:] != (sq, skv) or any(s != 1 for s in m.shape[:-2]):
        return False
    m = m.reshape(sq, skv)
    keep = np.tril(np.ones((sq, skv), dtype=bool), k=skv - sq)
    return bool(np.all(m[keep] == 0) and np.all(m[~keep] <= -1e4))


def _last_axis(m: Match, node: Node, rank: int) -> bool:
    dim = node.params.dim
    dims = dim if isinstance(dim, tuple) else (dim,)
    return len(dims) == 1 and dims[0] % rank == rank - 1


def attention_rewrite(m: Match) -> Rewrite | None:
    """-> ``FlashAttention`` in BNSD; see the module docstring."""
    ctx = m.ctx
    dq, dk, dv = ctx.desc(m["q"]), ctx.desc(m["k"]), ctx.desc(m["v"])
    if dq is None or dk is None or dv is None or not dq.rank == dk.rank == dv.rank == 4:
        return None
    b, n, sq, d = dq.shape
    bk, nk, skv, dk_ = dk.shape
    if dv.shape != dk.shape or dk_ != d or bk != b or n % nk:
        return None
    scale = m["scale"].params.scalar if "scale" in m else 1.0
    causal = False
    soft = m.get("softmax") or m.get("sms")
    if not _last_axis(m, soft, 4):
        return None
    if "sms" in m:
        scale *= m["sms"].params.scale
        causal = bool(m["sms"].params.causal)
    mask = m.get("mask")
    if mask is not None:
        dm = ctx.desc(mask)
        if dm is None:
            return None
        const = ctx.weight(mask)
        if const is not None and not causal and is_causal_mask(const, sq, skv):
            mask, causal = None, True
    params = ctx.params("FlashAttention", num_heads=n, num_kv_heads=nk, scale=float(scale),
                        causal=causal, layout="BNSD")
    pv = m["pv"]
    ins = (m["q"], m["k"], m["v"]) + ((mask,) if mask is not None else ())
    return Rewrite(add=(Node(pv.name, "FlashAttention", params, ins, pv.outputs),))


# ----------------------------------------------------------------------------- layouts
def _layout(node: Node, rank: int | None) -> str | None:
    lay = node.params.layout
    if lay is not None:
        return lay
    return None if rank is None else ("BSH" if rank == 3 else "BNSD")


_SWAP_NS = (0, 2, 1, 3)
BSND_PATTERN = Op("Transpose", (Op("FlashAttention", name="fa", partial=True),),
                  where=params_are(perm=_SWAP_NS), name="out_t")


def bsnd_rewrite(m: Match) -> Rewrite | None:
    """BNSD attention between ``Transpose(0,2,1,3)``s -> BSND without them."""
    ctx, fa = m.ctx, m["fa"]
    dq = ctx.desc(fa.inputs[0])
    if dq is None or _layout(fa, dq.rank) != "BNSD" or len(fa.inputs) < 3:
        return None
    srcs = []
    for t in fa.inputs[:3]:
        p = ctx.producer(t) if t else None
        if p is None or get_op(p.op).name != "Transpose" or tuple(p.params.perm) != _SWAP_NS:
            return None
        srcs.append(p.inputs[0])
    out = m["out_t"]
    node = Node(fa.name, "FlashAttention", fa.params.replace(layout="BSND"),
                (*srcs, *fa.inputs[3:]), out.outputs)
    return Rewrite(add=(node,), remove=(fa.name, out.name))


BSH_PATTERN = Op("Reshape", (Op("FlashAttention", name="fa", partial=True),), name="out_r")


def bsh_rewrite(m: Match) -> Rewrite | None:
    """BSND attention between head-splitting / merging reshapes -> BSH without them."""
    ctx, fa, out = m.ctx, m["fa"], m["out_r"]
    dq, dout = ctx.desc(fa.inputs[0]), ctx.desc(out.outputs[0])
    if dq is None or dout is None or _layout(fa, dq.rank) != "BSND" or len(fa.inputs) < 3:
        return None
    b, s, n, d = dq.shape
    if dout.shape != (b, s, n * d):
        return None
    srcs, heads = [], []
    for t in fa.inputs[:3]:
        p = ctx.producer(t) if t else None
        if p is None or get_op(p.op).name != "Reshape":
            return None
        dx, dy = ctx.desc(p.inputs[0]), ctx.desc(t)
        if dx is None or dy is None or dy.rank != 4 or dx.shape != (*dy.shape[:2],
                                                                    dy.shape[2] * dy.shape[3]):
            return None
        srcs.append(p.inputs[0])
        heads.append(dy.shape[2])
    params = fa.params.replace(layout="BSH", num_heads=heads[0], num_kv_heads=heads[1])
    node = Node(fa.name, "FlashAttention", params, (*srcs, *fa.inputs[3:]), out.outputs)
    return Rewrite(add=(node,), remove=(fa.name, out.name))


# ----------------------------------------------------------------------------- RoPE + attention
ROPE_ATTENTION_PATTERN = Op("FlashAttention", (Op("RoPE", name="rope", output=0),
                                               Op("RoPE", name="rope", output=1), "v"),
                            name="fa", partial=True)
_ROPE_FIELDS = ("rotary_dim", "base", "rotary_type", "position_offset", "max_seq_len")
_FA_FIELDS = ("num_heads", "num_kv_heads", "head_dim", "scale", "causal", "window", "dtype")


def rope_attention_rewrite(m: Match) -> Rewrite | None:
    """``RoPE(q, k)`` feeding an attention's q and k -> ``RopeFlashAttention``."""
    ctx, fa, rope = m.ctx, m["fa"], m["rope"]
    if any(t and ctx.desc(t) is None for t in rope.inputs):
        return None
    dq = ctx.desc(rope.inputs[0])
    rp = rope.params
    rope_layout = rp.layout or ("BSH" if dq.rank == 3 else "BSND")
    fa_layout = _layout(fa, dq.rank)
    if rope_layout != fa_layout:
        return None
    if fa_layout == "BSH":  # RoPE's head split must be the attention's
        heads = fa.params.num_heads
        rope_hd = rp.head_dim or (dq.shape[2] // rp.num_heads if rp.num_heads else None)
        if heads is None or rope_hd is None or dq.shape[2] != heads * rope_hd:
            return None
    b = bind_ids(get_op("RoPE"), rope, ctx.descs)
    fields = {f: getattr(fa.params, f) for f in _FA_FIELDS}
    fields.update({f: getattr(rp, f) for f in _ROPE_FIELDS})
    fields["layout"] = fa_layout
    params = ctx.params("RopeFlashAttention", **fields)
    rest = list(fa.inputs[3:]) + [""] * (2 - len(fa.inputs[3:]))
    ins = [b["q"], b["k"], fa.inputs[2], b["position_ids"] or "", b["cos"] or "",
           b["sin"] or "", *rest]
    while ins and not ins[-1]:
        ins.pop()
    node = Node(fa.name, "RopeFlashAttention", params, tuple(ins), fa.outputs)
    return Rewrite(add=(node,), remove=(fa.name, rope.name))


# ----------------------------------------------------------------------------- packed QKV
_SPLIT = tuple(Op("Split", ("qkv",), name="split", output=i) for i in range(3))
PACKED_QKV_PATTERN = Op(("FlashAttention", "RopeFlashAttention"), _SPLIT, name="fa",
                        partial=True)


def packed_qkv_rewrite(m: Match) -> Rewrite | None:
    """Attention on the three parts of one split -> attention on the packed tensor."""
    ctx, fa, split = m.ctx, m["fa"], m["split"]
    dq, dk, dx = (ctx.desc(t) for t in (fa.inputs[0], fa.inputs[1], m["qkv"]))
    if dq is None or dk is None or dx is None or dq.rank != 3 or _layout(fa, 3) != "BSH":
        return None
    if len(split.outputs) != 3 or split.params.dim % 3 != 2:
        return None
    heads = fa.params.num_heads
    if heads is None or dq.shape[2] % heads:
        return None
    d = dq.shape[2] // heads
    if dk.shape[2] % d:
        return None
    params = fa.params.replace(num_heads=heads, num_kv_heads=dk.shape[2] // d)
    ins = [m["qkv"], "", "", *fa.inputs[3:]]
    while ins and not ins[-1]:
        ins.pop()
    node = Node(fa.name, get_op(fa.op).name, params, tuple(ins), fa.outputs)
    return Rewrite(add=(node,), remove=(fa.name, split.name))
