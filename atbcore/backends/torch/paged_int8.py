"""Torch kernels of the int8 KV cache ops (:mod:`atbcore.ops.paged_int8`).

``ReshapeAndCacheInt8`` quantizes in float64 (bit-equal to the NumPy reference) and
writes the int8 rows and their scales in place: one C call on the CPU, else torch ops.
``PagedAttentionInt8``, one query per row (decode) on the CPU: the C kernel reads the
int8 rows in place (scores times the key scales, softmax weights times the value
scales: one byte read per cached element). Otherwise (several queries per row, no C
kernels) it dequantizes only the cache rows the call reads (the blocks its tables
use; of a one-block table only the rows up to the longest context) into fp32 and
runs :func:`.paged.paged_attention` on them.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ...ops.attention import effective_window
from ...runtime.binding import Slot, getter, resolve, same_objects
from ...tensor import copy_into
from ..cpu_kernels import torch_ops as ck
from ..cpu_kernels.torch_decode import paged_decode_attention_bound as \
    c_paged_decode_attention_bound
from ..cpu_kernels.torch_cache_int8 import reshape_and_cache_int8_bound as \
    c_reshape_and_cache_int8_bound
from . import kernel
from .paged import paged_attention

__all__ = ["quantize_int8", "reshape_and_cache_int8", "paged_attention_int8"]


def quantize_int8(x: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., D]`` -> (int8 ``[..., D]``, scales ``[...]`` in ``scale_dtype``):
    ``s = absmax / 127`` (stored), ``q = round(x / s)`` (0 where s is 0 or not finite)."""
    xf = x.double()
    s = (xf.abs().amax(dim=-1) / 127.0).to(scale_dtype)
    sf = s.double()
    ok = torch.isfinite(sf) & (sf > 0)
    r = torch.where(ok[..., None], xf / torch.where(ok, sf, torch.ones_like(sf))[..., None],
                    torch.zeros((), dtype=torch.float64, device=x.device))
    q = torch.nan_to_num(torch.round(r), nan=0.0).clamp_(-127.0, 127.0).to(torch.int8)
    return q, s


@kernel("ReshapeAndCacheInt8", impl="C quantizing row writes (CPU), else torch: float64 "
        "quantization per token and head, indexed writes of the int8 rows and their scales "
        "(in place; both bit-equal to the reference)", launches=ck.c_launches(52))
def reshape_and_cache_int8(p, ins):
    kc, vc, ks, vs = (ins[n] for n in ("key_cache", "value_cache", "key_scale", "value_scale"))
    call = None if ck.why_not(ins["key"]) else c_reshape_and_cache_int8_bound(
        ins["key"], ins["value"], kc, vc, ks, vs, ins["slot_mapping"])
    if call is not None:
        call()
        return [kc, vc, ks, vs]
    slots = ins["slot_mapping"].long()
    keep = slots >= 0  # slot -1: a padding token, not stored
    s = slots[keep]
    blk, off = s // kc.shape[1], s % kc.shape[1]
    for x, cache, scale in ((ins["key"], kc, ks), (ins["value"], vc, vs)):
        q, sc = quantize_int8(x[keep], scale.dtype)
        cache[blk, off] = q
        scale[blk, off] = sc
    return [kc, vc, ks, vs]  # the caller's caches themselves


def _dequantized(cache: torch.Tensor, scale: torch.Tensor, used: torch.Tensor, rows: int
                 ) -> torch.Tensor:
    """Blocks ``used`` of an int8 cache, their first ``rows`` rows, as fp32."""
    # [U, rows, Hkv, D] * [U, rows, Hkv, 1]
    return cache[used, :rows].float() * scale[used, :rows, :, None].float()


def _c_decode_reasons(ins: dict) -> str | None:
    """Why the C decode kernel cannot read these int8 caches in place (None: it can)."""
    q, ks, vs = ins["query"], ins["key_scale"], ins["value_scale"]
    why = ck.why_not(q, ks, vs)
    if why is None and not (ins["key_cache"].is_cpu and ins["value_cache"].is_cpu):
        why = "int8 caches off the CPU"
    if why is None and q.shape[2] > 512:
        why = "head_dim > 512"
    return why


def _bind_paged_attention_int8(p: Any, ins: Mapping[str, Any], outs: list, ctx: Any) -> Any:
    """Decode into a planned buffer: the C kernel packed once per set of cache, scale
    and table tensors (tables checked per call unless the node's inputs are trusted);
    None (the generic call) otherwise."""
    q, o, bt = ins["query"], outs[0], ins["block_tables"]
    qshape = q.desc.shape if type(q) is Slot else tuple(q.shape)
    rows = bt.desc.shape[0] if type(bt) is Slot else bt.shape[0]
    if type(o) is Slot or qshape[0] != rows or qshape[2] > 512:
        return None
    names = ("query", "key_cache", "value_cache", "key_scale", "value_scale", "block_tables",
             "context_lens")
    gets = [getter(ins[n]) for n in names]
    qsl = ins.get("q_seq_lens")
    scale = p.scale if p.scale is not None else qshape[2] ** -0.5
    # the tensors bound (all but the query), the packed call, the query buffer it reads:
    # the query is copied into that buffer per call (an unfused RoPE hands a new tensor
    # every step; copying its few hundred values costs less than packing anew)
    state: list[Any] = [None, None, None]

    def call(env: list) -> None:
        cur = tuple(g(env) for g in gets)
        q = cur[0]
        qbuf = state[2]
        if not same_objects(cur[1:], state[0]) or qbuf is None or qbuf.shape != q.shape \
                or qbuf.dtype != q.dtype:
            got = dict(zip(names, cur))
            bound = qbuf = None
            if (_c_decode_reasons(got) is None and got["block_tables"].is_contiguous()
                    and got["context_lens"].is_contiguous()):
                kc = got["key_cache"]
                qbuf = torch.empty(q.shape, dtype=q.dtype)
                bound = c_paged_decode_attention_bound(
                    qbuf, kc, got["value_cache"], got["block_tables"],
                    got["context_lens"], scale=scale, out=o, check_tables=not ctx.trusted,
                    window=effective_window(p.window, 1, kc.shape[0] * kc.shape[1]),
                    key_scale=got["key_scale"], value_scale=got["value_scale"])
            state[:] = [cur[1:], bound, qbuf]
        if state[1] is not None:
            qbuf.copy_(q)
            if state[1]() is not None:
                return
        got = dict(zip(names, cur), q_seq_lens=resolve(qsl, env))
        copy_into(o, paged_attention_int8(p, got)[0])
    return call


@kernel("PagedAttentionInt8", impl="decode: C kernel reading the int8 rows in place and "
        "scaling scores and weights by the rows' scales (CPU); else the rows read "
        "dequantized to fp32, then PagedAttention's kernels", launches=ck.c_launches(23),
        bind=_bind_paged_attention_int8)
def paged_attention_int8(p, ins):
    q, kc, vc = ins["query"], ins["key_cache"], ins["value_cache"]
    bt, ctx = ins["block_tables"], ins["context_lens"]
    nb, bs = kc.shape[0], kc.shape[1]
    qsl = ins.get("q_seq_lens")
    if (qsl is None or q.shape[0] == bt.shape[0]) and _c_decode_reasons(ins) is None:
        window = effective_window(p.window, 1, nb * bs)
        scale = p.scale if p.scale is not None else q.shape[2] ** -0.5
        out = c_paged_decode_attention_bound(q, kc, vc, bt, ctx, scale=scale, window=window,
                                             key_scale=ins["key_scale"],
                                             value_scale=ins["value_scale"])()
        if out is not None:  # (None: an inf/NaN scale, handled by the dequantizing path)
            return [out]
    top = int(ctx.max())
    nblk = -(-top // bs)
    # entries past a row's context may be padding: any valid id stands in for them
    table = bt[:, :nblk].long().clamp(0, nb - 1)
    used, local = torch.unique(table, return_inverse=True)
    rows = min(bs, top) if nblk == 1 else bs
    got = {"query": q.float(), "block_tables": local.to(torch.int32).reshape(table.shape),
           "key_cache": _dequantized(kc, ins["key_scale"], used, rows),
           "value_cache": _dequantized(vc, ins["value_scale"], used, rows),
           "context_lens": ctx, "q_seq_lens": ins.get("q_seq_lens")}
    return [paged_attention(p, got)[0].to(q.dtype)]
