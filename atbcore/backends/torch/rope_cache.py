"""Torch kernel for RopeKVCache: q and k rotated and k, v written into the KV cache.

On the CPU this is one C kernel (the RoPE kernel with cache rows as its k/v
destination): tables are RoPE's cached ones, positions (and slots) are checked
before anything is written, and the caches are updated in place. With
``slot_mapping`` the caches are paged blocks and each token's row is its slot (the
``rope_cache`` fusion of an in-place cache block); the bound form packs that call
once per (positions, slots) tensor pair, which a cache feeder rewrites in place.
Elsewhere (CUDA, no C compiler, positions past any table) RoPE's torch composite
runs followed by two indexed writes (``index_put_``), logged.
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import InputError
from ...runtime.binding import Slot, getter, same_objects
from ...runtime.native_run import native_call, not_native
from ..cpu_kernels import torch_ops as ck
from . import kernel
from .rope import MAX_TABLE_LEN, _usable, c_unsupported, geometry, rope_c, rope_composite, \
    rope_tables

__all__: list[str] = []

_ROPE_INS = ("q", "k", "position_ids", "cos", "sin")


def _heads(x: torch.Tensor, lay: str, heads: int, d: int) -> torch.Tensor:
    """``x`` in ``lay`` as ``[B, S, H, D]`` (a view)."""
    if lay == "BSH":
        return x.unflatten(-1, (heads, d))
    return x if lay == "BSND" else x.transpose(1, 2)


def _flat(c: torch.Tensor) -> torch.Tensor:
    """Paged blocks ``[NB, BS, H, D]`` as ``[1, NB * BS, H, D]`` (a view)."""
    return c.view(1, -1, *c.shape[2:])


def _why_not_c(g: Any, rins: dict, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
               slots: Any) -> str | None:
    why = c_unsupported(g, rins) or ck.why_not(v, kc, vc)
    if why is None and (kc.stride(-1) != 1 or vc.stride(-1) != 1):
        why = "KV cache head_dim not contiguous"
    if why is None and slots is not None and not (kc.is_contiguous() and vc.is_contiguous()):
        why = "paged caches not contiguous (the kernel reads them flat)"
    return why


def _bind_rope_kv_cache(p: Any, ins: dict, outs: list, ctx: Any) -> Any:
    """The paged form with positions (the in-place cache block's decode and prefill):
    the C call packed once per set of tensors (a program fed the same caches, index
    tensors and buffers each step packs once, the positions and slots read per call)
    over a table made now; the general call when a position is past it or the C
    kernel cannot take the tensors. None for any other form (the kernel's ``fn``)."""
    pos, slots = ins.get("position_ids"), ins.get("slot_mapping")
    if slots is None or pos is None or ins.get("cos") is not None or type(outs[0]) is Slot:
        return None
    names = ("q", "k", "v", "key_cache", "value_cache", "position_ids", "slot_mapping")
    gets = [getter(ins[n]) for n in names]
    qo = outs[0]
    ok, ov = (o.index if type(o) is Slot else None for o in outs[1:])
    state: list[Any] = [None, None]  # the tensors bound, their packed call (or None)

    def pack(q, k, v, kc, vc, pt, sl) -> Any:
        g = geometry("RopeKVCache", p, {"q": q, "k": k, "position_ids": pt})
        if (_why_not_c(g, {"q": q, "k": k}, v, kc, vc, sl) or not _usable(qo, q)
                or q.device.type != "cpu"):
            return None
        ct, st = rope_tables(g.rotary_dim, p.base, p.rotary_type,
                             min(int(p.max_seq_len), MAX_TABLE_LEN), q.device)
        return ck.rope_packed(
            q, k, ct, st, pos=pt, slot=sl.contiguous(), layout=g.layout, head_dim=g.head_dim,
            rotary_dim=g.rotary_dim, q_heads=g.q_heads, k_heads=g.k_heads or 0,
            interleave=p.rotary_type == "interleave", batch=g.batch, seq=g.seq, q_out=qo,
            k_out=_flat(kc), v=v, v_out=_flat(vc), cache_len=kc.shape[0] * kc.shape[1],
            table_len=ct.shape[0])

    def call(env: list) -> None:
        cur = tuple(g(env) for g in gets)
        if not same_objects(cur, state[0]):
            state[:] = [cur, pack(*cur)]
        if state[1] is None:
            not_native()
        try:
            need = 1 if state[1] is None else state[1]()
        except ValueError as e:  # the C kernel checked every row before writing anything
            raise InputError("RopeKVCache", "position_ids / slot_mapping values",
                             ">= 0, inside the table and the cache", str(e)) from None
        if need:  # no packed call, or a position past its table: the general call
            rope_kv_cache(p, {**dict.fromkeys(("cos", "sin")), **dict(zip(names, cur))},
                          out=[qo])
        if ok is not None:
            env[ok] = cur[3]
        if ov is not None:
            env[ov] = cur[4]
    return native_call(call)


_bind_rope_kv_cache.fills_slots = True  # type: ignore[attr-defined]


@kernel("RopeKVCache", impl="C rope of q, k + k/v cache write (by position, or paged by slot), "
        "one kernel (CPU); else torch rotary + index_put_", launches=ck.c_launches(16),
        writes_out=True, bind=_bind_rope_kv_cache)
def rope_kv_cache(p, ins, out=None):
    rins = {n: ins.get(n) for n in _ROPE_INS}
    v, kc, vc, slots = ins["v"], ins["key_cache"], ins["value_cache"], ins.get("slot_mapping")
    g = geometry("RopeKVCache", p, rins)
    why = _why_not_c(g, rins, v, kc, vc, slots)
    if why is None:
        if slots is None:
            res = rope_c(p, g, rins, q_out=ck.out_at(out, 0), k_out=kc, v=v, v_out=vc,
                         cache_len=kc.shape[1], op="RopeKVCache")
        else:
            res = rope_c(p, g, rins, q_out=ck.out_at(out, 0), k_out=_flat(kc), v=v,
                         v_out=_flat(vc), cache_len=kc.shape[0] * kc.shape[1],
                         op="RopeKVCache", slot=slots.contiguous())
        if res is not None:
            return [res[0], kc, vc]
        why = "positions past any cos/sin table"
    ck.log_fallback("RopeKVCache", why)
    q_rot, k_rot = rope_composite(p, g, rins)
    kh, vh = _heads(k_rot, g.layout, g.k_heads, g.head_dim), _heads(v, g.layout, g.k_heads,
                                                                    g.head_dim)
    if slots is not None:  # token (b, s) -> block, row of its slot
        flat = slots.to(kc.device, torch.long)
        bidx, rows = flat // kc.shape[1], flat % kc.shape[1]
        kc[bidx, rows] = kh.reshape(-1, *kh.shape[2:])
        vc[bidx, rows] = vh.reshape(-1, *vh.shape[2:])
        return [ck.into(out, 0, q_rot), kc, vc]
    pos = ins.get("position_ids")
    if pos is None:
        rows = torch.arange(g.seq, device=kc.device) + int(p.position_offset)
    else:
        rows = pos.to(kc.device, torch.long)
    rows = (rows[None] if rows.dim() == 1 else rows).expand(g.batch, g.seq)   # [B, S]
    bidx = torch.arange(g.batch, device=kc.device)[:, None].expand(g.batch, g.seq)
    kc[bidx, rows] = kh                                                       # [B, S, Hkv, D]
    vc[bidx, rows] = vh
    return [ck.into(out, 0, q_rot), kc, vc]
