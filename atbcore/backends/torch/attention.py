"""Torch kernel of FlashAttention: ``torch.nn.functional.scaled_dot_product_attention``
(its fused flash kernel on CPU and CUDA; GQA through ``enable_gqa``), computed in
fp32 for half types so results round once.

Memory stays O(N): when no mask is needed (no mask, or causal with Sq == Skv) SDPA
runs on the whole sequence; otherwise queries are processed ``CHUNK`` rows at a time,
each chunk seeing only the key range it can reach, so neither scores nor a mask of
``[Sq, Skv]`` is ever materialised whole.

On the CPU, one query row per sequence (a decode step over a KV cache) runs as the
C decode attention (:mod:`atbcore.backends.cpu_kernels.torch_decode`), a boolean
mask that is the same for every head, ``seq_lens`` and a window becoming its key
mask; :func:`decode_bnsd` is that path for callers that skip the op's dispatch.
Other attention with no ``mask`` runs as the C prefill attention
(:mod:`atbcore.backends.cpu_kernels.torch_prefill`): causal and window rules and
per-row ``seq_lens`` are applied per key block inside the kernel, causal blocks
past a row block are skipped, half inputs are read as they are. Tiny blocks go
there too, although SDPA's call costs less for them: torch's fused CPU kernel
gets non-finite inputs wrong (a row whose only visible score is NaN comes out
finite, a NaN in a masked-out key leaks into other rows, a negative scale makes
causal rows NaN), and the C kernel follows the reference's arithmetic.

Where SDPA still runs on the CPU (an explicit mask, no C compiler) one sum per
input tells finite inputs from the rest, and non-finite ones take the written-out
masked softmax; a negative scale is folded into q (``q * s = (-q) * |s|``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...ops.attention import AttnDims, attention_dims, effective_window, split_packed
from ...tensor import TensorDesc
from ..cpu_kernels import torch_ops as ck
from ..cpu_kernels.torch_decode import decode_attention_bound
from . import kernel

__all__ = ["sdpa_attention", "to_bnsd", "from_bnsd", "CHUNK", "decode_bnsd", "why_not_decode"]

# The C decode attention's largest head_dim
DECODE_MAX_HEAD_DIM = 512

# Query rows per SDPA call when a mask must be built: a [B, 1, CHUNK, Skv] bool mask
# (4 MiB at Skv 8192) bounds the extra memory.
CHUNK = 512


def to_bnsd(x: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """A ``[B, N, S, D]`` view of ``x`` in ``layout``."""
    if layout == "BNSD":
        return x
    if layout == "BSH":
        b, s, hid = x.shape
        x = x.reshape(b, s, heads, hid // heads)  # a view, also for packed-QKV slices
    return x.transpose(1, 2)  # [B, S, N, D] -> [B, N, S, D]


def from_bnsd(o: torch.Tensor, layout: str) -> torch.Tensor:
    """``o`` [B, N, S, D] back into ``layout``."""
    if layout == "BNSD":
        return o
    o = o.transpose(1, 2)  # [B, N, S, D] -> [B, S, N, D]
    return o.reshape(o.shape[0], o.shape[1], -1) if layout == "BSH" else o


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                   causal: bool, window: int | None = None, mask: torch.Tensor | None = None,
                   kv_lens: torch.Tensor | None = None, chunk: int = CHUNK) -> torch.Tensor:
    """Attention of q ``[B, H, Sq, D]`` over k/v ``[B, Hkv, Skv, D]`` with the
    semantics of :mod:`atbcore.ops.attention` (bottom-right aligned positions,
    per-batch ``kv_lens``, sliding ``window`` implying causal, rows that see no key
    give zeros). Returns ``[B, H, Sq, D]`` in q's dtype."""
    b_, h, sq, d = q.shape
    skv = k.shape[2]
    gqa = k.shape[1] != h
    causal = causal or window is not None
    window = effective_window(window, sq, skv)
    if scale < 0:
        # torch's fused CPU kernel masks causal scores with -inf before scaling, so a
        # negative scale turns them into +inf and the rows into NaN; q * scale . k is
        # (-q) * |scale| . k, which every SDPA kernel gets right
        q, scale = -q, -scale
    # torch's fused kernels let a NaN/Inf in a masked-out key leak into rows that do
    # not see it (or drop one a row does see); non-finite inputs take the plain
    # masked-softmax path, whose result is the reference's
    exact = q.device.type == "cpu" and not all_finite(q, k, v)
    attend = _math_attention if exact else F.scaled_dot_product_attention
    if mask is None and kv_lens is None and window is None and not exact:
        if not causal or sq == 1 or sq == skv:
            # causal with one query row at the end sees every key: no mask at all.
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal and sq == skv > 1,
                                                  scale=scale, enable_gqa=gqa)
    dev = q.device
    lens = [skv] * b_ if kv_lens is None else [int(x) for x in kv_lens.tolist()]
    lens_t = torch.tensor(lens, device=dev)
    offs_t = (lens_t - sq).clamp(min=0)  # row i of entry b sits at max(lens[b] - sq, 0) + i
    m4 = None
    if mask is not None:
        m4 = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    out = q.new_empty(b_, h, sq, d)
    for r0 in range(0, sq, chunk):
        r1 = min(sq, r0 + chunk)
        # the key range [lo, hi) any row of this chunk can reach, over the batch
        hi = max(min(n, max(n - sq, 0) + r1) if causal else n for n in lens)
        lo = max(0, min(max(n - sq, 0) + r0 - window + 1 for n in lens)) if window else 0
        if hi <= lo:
            out[:, :, r0:r1] = 0
            continue
        keys = torch.arange(lo, hi, device=dev)
        pos = offs_t[:, None] + torch.arange(r0, r1, device=dev)[None]  # [B, c]
        allow = (keys < lens_t[:, None, None])  # [B, 1, K]
        if causal:
            allow = allow & (keys <= pos[:, :, None])  # [B, c, K]
        if window is not None:
            allow = allow & (keys > pos[:, :, None] - window)
        am = allow[:, None]  # [B, 1, c|1, K]
        if m4 is not None:
            mc = m4[:, :, r0:r1] if m4.shape[2] != 1 else m4
            mc = mc[..., lo:hi] if mc.shape[3] != 1 else mc
            mc = mc if mc.dtype == torch.bool else mc.to(q.dtype)  # per chunk: no full copy
            am = am & mc if mc.dtype == torch.bool else \
                torch.where(am, mc, torch.tensor(float("-inf"), dtype=q.dtype, device=dev))
        seen = am.any(-1, keepdim=True) if am.dtype == torch.bool else \
            (am > float("-inf")).any(-1, keepdim=True)
        o = attend(q[:, :, r0:r1], k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=am, scale=scale,
                   enable_gqa=gqa)
        # some SDPA backends give NaN for a row with no visible key; we define zeros.
        out[:, :, r0:r1] = o.masked_fill(~seen, 0.0)
    return out


def all_finite(*xs: torch.Tensor) -> bool:
    """True when no tensor holds NaN or Inf: one reduction each (a sum of finite
    values that overflows reads as non-finite, which only costs the exact path)."""
    return math.isfinite(sum(float(x.sum()) for x in xs))


def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    attn_mask: torch.Tensor, scale: float, enable_gqa: bool) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v written out: masked keys never contribute
    and non-finite values propagate exactly as the reference's arithmetic does."""
    if enable_gqa:  # [B, Hkv, S, D] -> [B, H, S, D]
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    return torch.softmax(s, -1) @ v


def _descs(ins) -> dict[str, TensorDesc | None]:
    return {n: None if x is None else TensorDesc.of(x) for n, x in ins.items()}


# launches of all_finite(q, k, v): the SDPA path's check on the CPU
FINITE_CHECK_LAUNCHES = 3


def _c_reason(p, ins, dims: AttnDims, q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why the C prefill attention does not take this call (None = it does)."""
    from ..cpu_kernels import torch_ops as ck
    from ..cpu_kernels.torch_prefill import MAX_HEAD_DIM

    why = ck.why_not(q, k)
    if why:
        return why
    if ins.get("mask") is not None:
        return "an explicit mask"
    for name, t in (("q", q), ("k", k), ("v", ins.get("v"))):
        if t is not None and t.dim() and t.stride(-1) != 1:
            return f"input {name!r} has a strided head dim (stride {t.stride(-1)})"
    if dims.head_dim > MAX_HEAD_DIM:
        return f"head_dim {dims.head_dim} > {MAX_HEAD_DIM}"
    return None


def _run_c(p, ins, dims: AttnDims, q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor) -> torch.Tensor:
    """The C prefill attention writing straight into q's layout."""
    from ..cpu_kernels.torch_prefill import prefill_attention

    b, h, sq, d = dims.batch, dims.heads, dims.q_len, dims.head_dim

    def bshd(x: torch.Tensor, heads: int) -> torch.Tensor:  # [B, S, N, D] views
        return to_bnsd(x, dims.layout, heads).transpose(1, 2)
    shape = {"BSH": (b, sq, h * d), "BSND": (b, sq, h, d), "BNSD": (b, h, sq, d)}[dims.layout]
    out = torch.empty(shape, dtype=q.dtype)
    lens = ins.get("seq_lens")
    prefill_attention(bshd(q, h), bshd(k, dims.kv_heads), bshd(v, dims.kv_heads),
                      scale=p.scale if p.scale is not None else dims.scale_default,
                      kv_lens=None if lens is None else lens.tolist(),
                      causal=p.causal or p.window is not None,
                      window=effective_window(p.window, sq, dims.kv_len), out=bshd(out, h))
    return out


def why_not_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None, q_len: int, head_dim: int) -> str | None:
    """Why the C decode attention does not take this call (None = it does): it serves
    one query row per sequence, a boolean mask only when it is the same for every
    head (a key mask)."""
    if q_len != 1:
        return f"{q_len} query rows"
    why = ck.why_not(q, k, v)
    if why:
        return why
    if k.dtype != v.dtype:
        return "k and v of different dtypes"
    if head_dim > DECODE_MAX_HEAD_DIM:
        return f"head_dim {head_dim} > {DECODE_MAX_HEAD_DIM}"
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return "an input with a strided head dim"
    if mask is not None:
        if mask.dtype != torch.bool:
            return "an additive (float) mask"
        if mask.dim() >= 3 and mask.shape[-3] != 1:
            return "a per-head mask"
    return None


def decode_key_mask(mask: torch.Tensor | None, lens: torch.Tensor | None,
                    window: int | None, batch: int, kv_len: int) -> torch.Tensor | None:
    """The keys one query row at the end of each sequence sees, as a bool ``[B, Skv]``
    (None = every key): the mask's row, keys below ``seq_lens[b]``, the last
    ``window`` of them."""
    key_mask = None
    if mask is not None:  # [.., 1, 1|Sq=1, Skv|1] -> [B, Skv]
        key_mask = mask.reshape(mask.shape[0] if mask.dim() == 4 else 1, -1)
        key_mask = key_mask.expand(batch, kv_len)
    if lens is not None or window is not None:
        keys = torch.arange(kv_len)
        n = (torch.full((batch,), kv_len) if lens is None else lens.to(torch.int64))[:, None]
        seen = keys[None] < n
        if window is not None:
            seen = seen & (keys[None] >= n - window)
        key_mask = seen if key_mask is None else key_mask & seen
    return None if key_mask is None else key_mask.contiguous()


def run_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: str,
               heads: int, kv_heads: int, scale: float, key_mask: torch.Tensor | None = None
               ) -> torch.Tensor:
    """One query row per sequence over its keys through the C decode attention,
    returned contiguous in ``layout`` (q, k, v in that layout; the caller has checked
    :func:`why_not_decode`)."""
    qb = to_bnsd(q, layout, heads)                           # [B, H, 1, D]
    b, h, _, d = qb.shape
    shape = {"BSH": (b, 1, h * d), "BSND": (b, 1, h, d), "BNSD": (b, h, 1, d)}[layout]
    out = torch.empty(shape, dtype=q.dtype)
    k_cache = to_bnsd(k, layout, kv_heads).transpose(1, 2)   # [B, Skv, KV, D]
    if k_cache.shape[1] == 0:  # no key at all: rows that see none give zeros
        return out.zero_()
    v_cache = to_bnsd(v, layout, kv_heads).transpose(1, 2)
    # the bound form checks what the unbound one would; all last dims are unit-stride
    decode_attention_bound(qb.select(2, 0), k_cache, v_cache, scale=scale, key_mask=key_mask,
                           out=out.view(b, h, d))(0, k_cache.shape[1])
    return out


def decode_bnsd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """FlashAttention's decode step without the op's dispatch, for callers that hold
    well-formed tensors (Hugging Face's attention hook, the ``torch.compile``
    backend): q ``[B, H, 1, D]`` over k/v ``[B, Hkv, Skv, D]``, no causal or window
    rule (one row at the end sees every key), an optional bool ``mask``
    broadcastable to ``[B, 1, 1, Skv]``. Returns the contiguous ``[B, H, 1, D]``
    output, or None where the C decode attention does not serve the call (then the
    op runs, with its checks)."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[2] != 1 or v.shape != k.shape:
        return None
    b, h, _, d = q.shape
    _, kv, skv, dk = k.shape
    if k.shape[0] != b or dk != d or kv == 0 or h % kv or skv == 0:
        return None
    if mask is not None and not (2 <= mask.dim() <= 4 and mask.shape[-1] in (1, skv)
                                 and mask.shape[-2] == 1
                                 and (mask.dim() < 4 or mask.shape[0] in (1, b))):
        return None
    if why_not_decode(q, k, v, mask, 1, d) is not None:
        return None
    key_mask = None if mask is None else decode_key_mask(mask, None, None, b, skv)
    out = torch.empty((b, h, 1, d), dtype=q.dtype)
    decode_attention_bound(q.select(2, 0), k.transpose(1, 2), v.transpose(1, 2), scale=scale,
                           key_mask=key_mask, out=out.view(b, h, d))(0, skv)
    return out


def _run(p, ins, dims: AttnDims) -> torch.Tensor:
    q, k, v = ins["q"], ins["k"], ins["v"]
    if dims.packed:
        q, k, v = split_packed(q, dims)
    if q.is_cpu and dims.q_len == 1 and why_not_decode(
            q, k, v, ins.get("mask"), dims.q_len, dims.head_dim) is None:
        window = effective_window(p.window, 1, dims.kv_len)
        key_mask = decode_key_mask(ins.get("mask"), ins.get("seq_lens"), window,
                                   dims.batch, dims.kv_len)
        return run_decode(q, k, v, layout=dims.layout, heads=dims.heads,
                          kv_heads=dims.kv_heads, key_mask=key_mask,
                          scale=p.scale if p.scale is not None else dims.scale_default)
    if q.is_cpu:
        why = _c_reason(p, ins, dims, q, k)
        if why is None:
            return _run_c(p, ins, dims, q, k, v)
        from ..cpu_kernels import torch_ops as ck

        ck.log_fallback("FlashAttention", why)
    lens = ins.get("seq_lens")
    o = sdpa_attention(to_bnsd(q, dims.layout, dims.heads).float(),
                       to_bnsd(k, dims.layout, dims.kv_heads).float(),
                       to_bnsd(v, dims.layout, dims.kv_heads).float(),
                       scale=p.scale if p.scale is not None else dims.scale_default,
                       causal=p.causal, window=p.window, mask=ins.get("mask"),
                       kv_lens=lens)
    return from_bnsd(o, dims.layout).to(ins["q"].dtype)


@kernel("FlashAttention", impl="C decode attention on the CPU for one query row (a key "
        "mask at most), C prefill attention on the CPU (no mask), else torch "
        "scaled_dot_product_attention (fp32 compute, query-chunked when a mask is built; "
        "on the CPU non-finite inputs take the written-out softmax)",
        launches=ck.c_launches(1 + FINITE_CHECK_LAUNCHES))
def flash_attention(p, ins):
    dims = attention_dims("FlashAttention", p, _descs(ins))
    return [_run(p, ins, dims).contiguous()]
