"""The torch backend's CUDA kernels written in Triton (:mod:`atbcore.backends.triton`).

Each registration pairs a device-free ``*_reasons`` check (params and shapes the
kernel does not cover) with the device check (triton importable, CUDA compute
capability); any reason sends the call to the op's torch composite, logged. The
Triton modules are imported on the first CUDA call, never on a CPU-only path.
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

import torch

from ...ops.activation import get_activation
from ...ops.attention import attention_dims, effective_window, split_packed
from ...tensor import TensorDesc
from ..triton import device_reason
from .activation import c_activation
from .device_kernels import device_kernel
from .rope import MAX_TABLE_LEN, _token_cos_sin, geometry, rope_tables
from .rope_cache import _heads

__all__ = ["norm_reasons", "gated_reasons", "rope_reasons", "rope_kv_cache_reasons",
           "paged_reasons", "prefill_reasons"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _triton(name: str) -> Any:
    return importlib.import_module(f"atbcore.backends.triton.{name}")


def _device(*tensors: Any) -> str | None:
    for t in tensors:
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            return f"Triton kernels take torch tensors; given {type(t).__name__}"
        if t.dtype not in _FLOATS:
            return f"Triton kernels take fp32/fp16/bf16; given {str(t.dtype)[6:]}"
    return device_reason(tensors[0])


def _norm_cols(p: Any, x: torch.Tensor, w: torch.Tensor | None) -> int:
    shape = p.normalized_shape or (tuple(w.shape) if w is not None else (x.shape[-1],))
    n = 1
    for s in shape:
        n *= int(s)
    return n


# ----------------------------------------------------------------------------- norms


def norm_reasons(p: Any, ins: Mapping[str, Any]) -> str | None:
    """Why the Triton RmsNorm cannot take this call (device aside)."""
    x, w = ins["x"], ins.get("weight")
    if w is None:
        return "RmsNorm without a weight"
    n = _norm_cols(p, x, w)
    if n > _triton("norm").MAX_COLS:
        return f"normalized size {n} > {_triton('norm').MAX_COLS} (one row per program)"
    return None


def _norm_why(p: Any, ins: Mapping[str, Any]) -> str | None:
    return _device(ins["x"], ins.get("weight"), ins.get("residual")) or norm_reasons(p, ins)


@device_kernel("RmsNorm", "cuda", why_not=_norm_why, provider="triton",
               impl="Triton rms_norm, one program per row (fp32 statistics)")
def rms_norm_cuda(p: Any, ins: Mapping[str, Any], out: list | None = None) -> list:
    x, w = ins["x"], ins["weight"]
    y, _ = _triton("norm").rms_norm(x, w, _norm_cols(p, x, w), p.eps, p.weight_offset,
                                    out=None if not out else out[0])
    return [y]


@device_kernel("AddRmsNorm", "cuda", why_not=_norm_why, provider="triton",
               impl="Triton add + rms_norm, one program per row (fp32 statistics)")
def add_rms_norm_cuda(p: Any, ins: Mapping[str, Any], out: list | None = None) -> list:
    x, w = ins["x"], ins["weight"]
    o = out or [None, None]
    y, s = _triton("norm").rms_norm(x, w, _norm_cols(p, x, w), p.eps, p.weight_offset,
                                    residual=ins["residual"], out=o[0],
                                    sum_out=o[1] if len(o) > 1 else None)
    return [y, s]


# ----------------------------------------------------------------------------- SwiGLU / GeGLU


def gated_reasons(op: str, p: Any, ins: Mapping[str, Any]) -> str | None:
    """Why the Triton gated activation cannot take this call (device aside)."""
    name, why = c_activation(get_activation(p.activation_name(), op))
    if why:
        return why
    if name not in _triton("activation").ACTIVATIONS:
        return f"activation {name!r} has no Triton kernel"
    x, up = ins["x"], ins.get("up")
    if up is not None and (up.shape != x.shape or up.dtype != x.dtype):
        return "gate and up differ in shape or dtype"
    return None


def _gated(op: str) -> None:
    def why(p: Any, ins: Mapping[str, Any]) -> str | None:
        return _device(ins["x"], ins.get("up")) or gated_reasons(op, p, ins)

    @device_kernel(op, "cuda", why_not=why, provider="triton",
                   impl="Triton act(gate) * up, fp32 compute")
    def run(p: Any, ins: Mapping[str, Any], out: list | None = None) -> list:
        name, _ = c_activation(get_activation(p.activation_name(), op))
        return [_triton("activation").gated(ins["x"], name, up=ins.get("up"),
                                             out=None if not out else out[0])]


for _op in ("SwiGLU", "GeGLU"):
    _gated(_op)


# ----------------------------------------------------------------------------- RoPE + cache

_ROPE_INS = ("q", "k", "position_ids", "cos", "sin")


def rope_kv_cache_reasons(p: Any, ins: Mapping[str, Any]) -> str | None:
    """Why the Triton RopeKVCache cannot take this call (device aside)."""
    if p.rotary_type != "half":
        return f"rotary_type {p.rotary_type!r}: the Triton kernel rotates the 'half' layout"
    kc, vc = ins["key_cache"], ins["value_cache"]
    if kc.stride(-1) != 1 or vc.stride(-1) != 1:
        return "KV cache head_dim not contiguous"
    paged = ins.get("slot_mapping") is not None
    if paged and not (kc.is_contiguous() and vc.is_contiguous()):
        return "slot_mapping over non-contiguous paged caches (written as flat rows)"
    if ins.get("cos") is None and _table_len(kc, paged) > MAX_TABLE_LEN:
        return f"cache length {_table_len(kc, paged)} > {MAX_TABLE_LEN} (no cos/sin table " \
               "that long)"
    return None


def _table_len(kc: torch.Tensor, paged: bool) -> int:
    """Positions a cache can hold: a paged cache's every row may belong to one sequence."""
    return kc.shape[0] * kc.shape[1] if paged else kc.shape[1]


def _rope_why(p: Any, ins: Mapping[str, Any]) -> str | None:
    return (_device(ins["q"], ins["k"], ins["v"], ins["key_cache"], ins["value_cache"])
            or rope_kv_cache_reasons(p, ins))


def _table_rows(p: Any, g: Any, ins: Mapping[str, Any], cache_rows: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cos, sin, rows) with cos/sin ``[P, rd]`` and rows int ``[B, S]`` into them."""
    q, pos, cos, sin = ins["q"], ins.get("position_ids"), ins.get("cos"), ins.get("sin")
    if cos is None:  # positions < S_max: a table as long as the cache needs no host sync
        paged = ins.get("slot_mapping") is not None
        length = max(_table_len(ins["key_cache"], paged), int(p.position_offset) + g.seq)
        ct, st = rope_tables(g.rotary_dim, p.base, "half", length, q.device)
        return ct, st, cache_rows
    if pos is not None:  # a table indexed by the ids
        return cos, sin, cache_rows
    seq = torch.arange(g.seq, device=q.device)
    if cos.dim() == 2:  # per token [S, rd]
        return cos, sin, seq[None].expand(g.batch, g.seq)
    if cos.shape[0] == 1:  # [1, S, rd]
        return cos[0], sin[0], seq[None].expand(g.batch, g.seq)
    rows = torch.arange(g.batch, device=q.device)[:, None] * g.seq + seq[None]
    return cos.reshape(-1, g.rotary_dim), sin.reshape(-1, g.rotary_dim), rows


@device_kernel("RopeKVCache", "cuda", why_not=_rope_why, provider="triton",
               impl="Triton rope ('half') of q and k with the k/v cache write (by position, "
               "or paged by slot), one kernel")
def rope_kv_cache_cuda(p: Any, ins: Mapping[str, Any], out: list | None = None) -> list:
    rins = {n: ins.get(n) for n in _ROPE_INS}
    g = geometry("RopeKVCache", p, rins)
    q, k, v, kc, vc = ins["q"], ins["k"], ins["v"], ins["key_cache"], ins["value_cache"]
    o = out[0] if out and out[0] is not None and out[0].shape == q.shape \
        and out[0].dtype == q.dtype else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    pos = ins.get("position_ids")
    if pos is None:
        rows = (torch.arange(g.seq, device=q.device) + int(p.position_offset))[None]
    else:
        rows = pos[None] if pos.dim() == 1 else pos
    rows = rows.expand(g.batch, g.seq)
    cos, sin, trows = _table_rows(p, g, ins, rows)
    slots = ins.get("slot_mapping")
    if slots is not None:  # paged: token (b, s) goes to flat row slots[b * S + s]
        rows = slots.reshape(g.batch, g.seq)
    view = {n: _heads(t, g.layout, h, g.head_dim)                          # [B, S, H, D]
            for n, t, h in (("q", q, g.q_heads), ("k", k, g.k_heads), ("v", v, g.k_heads),
                            ("o", o, g.q_heads))}
    _triton("rope_cache").rope_kv_cache(view["q"], view["k"], view["v"], view["o"], kc, vc,
                                        cos, sin, rows, trows, g.rotary_dim,
                                        paged=slots is not None)
    return [o, kc, vc]


def rope_reasons(p: Any, ins: Mapping[str, Any]) -> str | None:
    """Why the Triton RoPE cannot take this call (device aside)."""
    if p.rotary_type != "half":
        return f"rotary_type {p.rotary_type!r}: the Triton kernel rotates the 'half' layout"
    return None


def _rope_plain_why(p: Any, ins: Mapping[str, Any]) -> str | None:
    return _device(ins["q"], ins.get("k")) or rope_reasons(p, ins)


def _buffer_like(out: list | None, i: int, x: torch.Tensor) -> torch.Tensor:
    o = None if not out or i >= len(out) else out[i]
    if o is not None and o.shape == x.shape and o.dtype == x.dtype and o.device == x.device \
            and (o.numel() == 0 or o.stride(-1) == 1):
        return o
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@device_kernel("RoPE", "cuda", why_not=_rope_plain_why, provider="triton",
               impl="Triton rope ('half') of q and k in one kernel (per-token cos/sin rows "
               "gathered from the cached tables)")
def rope_cuda(p: Any, ins: Mapping[str, Any], out: list | None = None) -> list:
    rins = {n: ins.get(n) for n in _ROPE_INS}
    g = geometry("RoPE", p, rins)
    q, k = ins["q"], ins.get("k")
    cos, sin = _token_cos_sin(p, g, rins, q.device)                     # fp32 [B|1, S, rd]
    seq = torch.arange(g.seq, device=q.device)
    rows = seq[None] if cos.shape[0] == 1 else \
        torch.arange(g.batch, device=q.device)[:, None] * g.seq + seq[None]
    outs = [_buffer_like(out, 0, q)] + ([] if k is None else [_buffer_like(out, 1, k)])
    view = lambda t, h: _heads(t, g.layout, h, g.head_dim)             # noqa: E731 [B,S,H,D]
    _triton("rope_cache").rope(
        view(q, g.q_heads), None if k is None else view(k, g.k_heads), view(outs[0], g.q_heads),
        None if k is None else view(outs[1], g.k_heads), cos.reshape(-1, g.rotary_dim),
        sin.reshape(-1, g.rotary_dim), rows.expand(g.batch, g.seq), g.rotary_dim)
    return outs


# ----------------------------------------------------------------------------- PagedAttention


def paged_reasons(p: Any, ins: Mapping[str, Any]) -> str | None:
    """Why the Triton decode attention cannot take this call (device aside)."""
    q, kc, vc = ins["query"], ins["key_cache"], ins["value_cache"]
    if kc.dtype != q.dtype or vc.dtype != q.dtype:
        return f"cache dtype {str(kc.dtype)[6:]}/{str(vc.dtype)[6:]} differs from the query's"
    limit = _triton("paged").MAX_HEAD_DIM
    if q.shape[2] > limit:
        return f"head_dim {q.shape[2]} > {limit}"
    if kc.stride(-1) != 1 or vc.stride(-1) != 1:
        return "KV cache head_dim not contiguous"
    return None


def _paged_why(p: Any, ins: Mapping[str, Any]) -> str | None:
    return _device(ins["query"], ins["key_cache"], ins["value_cache"]) or paged_reasons(p, ins)


@device_kernel("PagedAttention", "cuda", why_not=_paged_why, provider="triton",
               impl="Triton decode attention over the blocks in place (GQA groups share "
               "each K/V read; split-K over long contexts); several tokens per sequence: "
               "Triton flash attention over the blocks in place; fp32 softmax")
def paged_attention_cuda(p: Any, ins: Mapping[str, Any], out: list | None = None) -> list:
    q, kc = ins["query"], ins["key_cache"]
    scale = p.scale if p.scale is not None else q.shape[2] ** -0.5
    qsl = ins.get("q_seq_lens")
    if qsl is not None and q.shape[0] != ins["block_tables"].shape[0]:  # prefill / chunks
        return [_triton("paged_prefill").paged_prefill_attention(
            q, kc, ins["value_cache"], ins["block_tables"], ins["context_lens"], qsl, scale,
            causal=p.causal, window=p.window, out=None if not out else out[0])]
    window = effective_window(p.window, 1, kc.shape[0] * kc.shape[1])
    return [_triton("paged").paged_decode_attention(
        q, kc, ins["value_cache"], ins["block_tables"], ins["context_lens"], scale,
        window=window, out=None if not out else out[0])]


# ----------------------------------------------------------------------------- FlashAttention
# Why Triton here and not SDPA: the torch kernel runs SDPA in fp32 (so results round
# once), which on CUDA rules out SDPA's flash backend (half inputs only) and leaves
# the memory-efficient or math kernel, with a mask materialised per query chunk for
# seq_lens, bottom-right causal (Sq != Skv) and windows. The Triton kernel reads half
# inputs as they are with fp32 accumulation, applies those rules per key block and
# skips blocks no row can see. An explicit mask stays with SDPA.


def prefill_reasons(p: Any, ins: Mapping[str, Any]) -> str | None:
    """Why the Triton prefill attention cannot take this FlashAttention call (device aside)."""
    if ins.get("mask") is not None:
        return "an explicit mask (torch SDPA takes it)"
    dims = attention_dims("FlashAttention", p, {n: None if x is None else TensorDesc.of(x)
                                                for n, x in ins.items()})
    limit = _triton("prefill").MAX_HEAD_DIM
    if dims.head_dim > limit:
        return f"head_dim {dims.head_dim} > {limit}"
    for name in ("q", "k", "v"):
        t = ins.get(name)
        if t is not None and t.stride(-1) != 1:
            return f"input {name!r} has a strided head dim"
    return None


def _prefill_why(p: Any, ins: Mapping[str, Any]) -> str | None:
    return _device(ins["q"], ins.get("k"), ins.get("v")) or prefill_reasons(p, ins)


@device_kernel("FlashAttention", "cuda", why_not=_prefill_why, provider="triton",
               impl="Triton flash attention (GQA, bottom-right causal / window / seq_lens per "
               "key block, blocks no row sees skipped), fp32 softmax")
def flash_attention_cuda(p: Any, ins: Mapping[str, Any], out: list | None = None) -> list:
    dims = attention_dims("FlashAttention", p, {n: None if x is None else TensorDesc.of(x)
                                                for n, x in ins.items()})
    q, k, v = ins["q"], ins.get("k"), ins.get("v")
    if dims.packed:
        q, k, v = split_packed(q, dims)
    o = out[0] if out and out[0] is not None and out[0].stride(-1) == 1 else None
    return [_triton("prefill").prefill_attention(
        q, k, v, layout=dims.layout, heads=dims.heads, kv_heads=dims.kv_heads,
        scale=p.scale if p.scale is not None else dims.scale_default,
        causal=p.causal or p.window is not None,  # a window implies causal
        window=effective_window(p.window, dims.q_len, dims.kv_len),
        seq_lens=ins.get("seq_lens"), out=o)]
