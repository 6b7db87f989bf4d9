"""The torch backend's NPU attention kernels (registered for device ``npu``).

* FlashAttention: one query token per row on A2/A3 in fp16/bf16 (decode over a
  contiguous cache) runs ``npu_fused_infer_attention_score`` (kv lengths given on the
  host become ``actual_seq_lengths_kv``, so only those keys are read), on 310P in fp16
  ``npu_incre_flash_attention``; any other call on A2/A3
  ``npu_fusion_attention``. Both take atb's layouts (BSH/BNSD/BSND) as they are. A
  causal call with no other masking, Sq <= Skv, uses ``sparse_mode=3`` (bottom-right
  causal) with the compressed 2048x2048 mask; otherwise every rule of the op (kv
  lengths, causal, window, a bool mask) becomes one explicit bool ``atten_mask``
  (True = masked, torch_npu's convention, the opposite of atb's bool masks), built
  on the device without a host sync, and rows that see no key are zeroed as atb
  defines them.
* PagedAttention (decode: one query per sequence): ``npu_fused_infer_attention_score``
  with ``block_table`` over the caches viewed ``[blocks, block_size, Hkv*D]`` (A2/A3),
  else the ATB op ``_npu_paged_attention`` when the NNAL package is there (not on
  310P, whose ATB cache ops take NZ caches); what neither reads in place (several
  query tokens per sequence, a window, 310P) runs FlashAttention's ops above over
  the sequences' rows gathered contiguous (:mod:`.paged_gather`).
* ReshapeAndCache: the ATB op ``_npu_reshape_and_cache`` (NNAL; not on 310P).

Constraints (``reference/torch_npu.md`` and op-plugin's docs) are reasons; a call
breaking one runs the torch kernel, logged.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from ...ops.attention import attention_dims, split_packed
from ...tensor import TensorDesc
from ..torch.device_kernels import device_kernel
from . import into_out, nnal_reason, npu_module, soc_family, unavailable_reason
from .paged_gather import gathered_reason, paged_attention_gathered

__all__ = ["flash_attention_reasons", "paged_attention_reasons", "reshape_and_cache_reasons",
           "visible_mask"]

_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_BIG = 2147483647
_CAUSAL_2048: dict[torch.device, torch.Tensor] = {}


def _name(dt: torch.dtype) -> str:
    return str(dt)[6:]


def _descs(ins: Mapping[str, Any]) -> dict[str, TensorDesc | None]:
    return {n: None if x is None else TensorDesc.of(x) for n, x in ins.items()}


# ----------------------------------------------------------------------------- FlashAttention


def _decode_fia(dims: Any, q: torch.Tensor, mask: Any) -> bool:
    """Whether npu_fused_infer_attention_score serves this call (else npu_fusion_attention)."""
    per_head_mask = mask is not None and mask.dim() == 4 and mask.shape[1] != 1
    return (dims.q_len == 1 and soc_family() in ("A2", "A3") and q.dtype in _HALF
            and not dims.packed and dims.batch <= 65536 and dims.head_dim <= 512
            and dims.heads // dims.kv_heads <= 64 and not per_head_mask)


def _incre_reason(dims: Any, q: torch.Tensor, mask: Any) -> str | None:
    """Why npu_incre_flash_attention (310P: decode, fp16) cannot take this call."""
    if dims.q_len != 1:
        return "310P has no prefill attention op here (npu_fusion_attention is A2/A3)"
    if q.dtype != torch.float16:
        return f"npu_incre_flash_attention on 310P takes fp16; given {_name(q.dtype)}"
    if dims.packed or dims.batch > 256 or dims.heads > 256 or dims.head_dim > 512 \
            or dims.heads // dims.kv_heads > 64:
        return "npu_incre_flash_attention on 310P takes B, N <= 256, D <= 512, N/Nkv <= 64"
    if mask is not None and (mask.dtype != torch.bool or mask.dim() == 4 and mask.shape[1] != 1):
        return "npu_incre_flash_attention takes one bool key mask per row (no per-head mask)"
    return None


def flash_attention_reasons(p: Any, ins: Mapping[str, Any]) -> str | None:
    """Why neither npu_fusion_attention nor npu_fused_infer_attention_score takes
    this FlashAttention call."""
    why = unavailable_reason()
    if why:
        return why
    fam = soc_family()
    dims = attention_dims("FlashAttention", p, _descs(ins))
    q, mask = ins["q"], ins.get("mask")
    if fam == "310P":
        return _incre_reason(dims, q, mask)
    if fam not in ("A2", "A3"):
        return f"npu_fusion_attention is documented for A2/A3; SoC family {fam}"
    if q.dtype not in _FLOATS:
        return f"npu_fusion_attention takes fp16/bf16/fp32; given {_name(q.dtype)}"
    if mask is not None and mask.dtype != torch.bool:
        return ("an additive float mask: npu_fusion_attention takes a bool atten_mask "
                "(pse is a bias, not a mask)")
    if not 1 <= dims.head_dim <= 768:
        return f"npu_fusion_attention takes head_dim 1-768; given {dims.head_dim}"
    if dims.heads > 256:
        return f"npu_fusion_attention takes <= 256 heads; given {dims.heads}"
    return None


def visible_mask(dims: Any, causal: bool, window: int | None, mask: Any, lens: Any,
                 device: torch.device) -> torch.Tensor:
    """Bool ``[B, 1|H, Sq, Skv]``, True where a query row may see a key (atb's rules,
    bottom-right aligned; see :mod:`atbcore.ops.attention`), built on ``device``."""
    b, sq, skv = dims.batch, dims.q_len, dims.kv_len
    keys = torch.arange(skv, device=device)
    if lens is None:
        kv_len = torch.full((b,), skv, dtype=torch.long, device=device)
    else:
        kv_len = lens.to(device=device, dtype=torch.long)
    pos = (kv_len - sq).clamp(min=0)[:, None] + torch.arange(sq, device=device)  # [B, Sq]
    allow = keys[None, None, :] < kv_len[:, None, None]                          # [B, 1, Skv]
    if causal or window is not None:
        allow = allow & (keys[None, None, :] <= pos[:, :, None])
    if window is not None:
        allow = allow & (keys[None, None, :] > pos[:, :, None] - window)
    allow = allow[:, None]                                                       # [B, 1, Sq, Skv]
    if mask is not None:
        m = mask.to(device)
        allow = allow & m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))
    return allow


def _causal_2048(device: torch.device) -> torch.Tensor:
    m = _CAUSAL_2048.get(device)
    if m is None:  # torch_npu's compressed causal mask: True above the diagonal
        m = _CAUSAL_2048[device] = torch.triu(torch.ones(2048, 2048, dtype=torch.bool,
                                                         device=device), diagonal=1)
    return m


def _zero_unseen(o: torch.Tensor, allow: torch.Tensor, layout: str) -> torch.Tensor:
    """``o`` with the rows that see no key set to zero (atb's definition; whatever the
    device left there, NaN included, is replaced)."""
    unseen = ~allow.any(-1)                                                      # [B, 1|H, Sq]
    if layout == "BNSD":
        return o.masked_fill(unseen[..., None], 0)
    unseen = unseen.transpose(1, 2)                                              # [B, Sq, 1|H]
    if layout == "BSND":
        return o.masked_fill(unseen[..., None], 0)
    b, s, hid = o.shape
    h = unseen.shape[-1]                                    # BSH: [B, Sq, h, hid/h]
    return o.view(b, s, h, hid // h).masked_fill(unseen[..., None], 0).view(b, s, hid)


@device_kernel("FlashAttention", "npu", why_not=flash_attention_reasons, provider="torch_npu",
               available=unavailable_reason,
               impl="torch_npu.npu_fused_infer_attention_score (one query row, A2/A3 half) / "
                    "npu_incre_flash_attention (one query row, 310P) / npu_fusion_attention")
def flash_attention_npu(p: Any, ins: Mapping[str, Any], out: list | None = None) -> list:
    dims = attention_dims("FlashAttention", p, _descs(ins))
    q, k, v = ins["q"], ins.get("k"), ins.get("v")
    if dims.packed:
        q, k, v = split_packed(q, dims)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    mask, lens = ins.get("mask"), ins.get("seq_lens")
    scale = p.scale if p.scale is not None else 1.0 / math.sqrt(dims.head_dim)
    npu = npu_module()
    causal = p.causal or p.window is not None
    # kv lengths held on the host (a decode plan's) bound the keys the decode ops read
    host = None if lens is None or lens.device.type != "cpu" else [int(n) for n in lens.tolist()]
    if _decode_fia(dims, q, mask):
        allow = visible_mask(dims, causal, p.window, mask, lens, q.device)      # [B, 1, 1, Skv]
        o, _lse = npu.npu_fused_infer_attention_score(
            q, k, v, atten_mask=~allow, actual_seq_lengths_kv=host, num_heads=dims.heads,
            scale=scale, input_layout=dims.layout, num_key_value_heads=dims.kv_heads)
        o = _zero_unseen(o, allow, dims.layout)
    elif soc_family() == "310P":  # decode only (see _incre_reason)
        allow = visible_mask(dims, causal, p.window, mask, lens, q.device)      # [B, 1, 1, Skv]
        o = npu.npu_incre_flash_attention(
            q, k, v, atten_mask=~allow, actual_seq_lengths=host, num_heads=dims.heads,
            scale_value=scale, input_layout=dims.layout, num_key_value_heads=dims.kv_heads)
        o = _zero_unseen(o, allow, dims.layout)
    elif (causal and p.window is None and mask is None and lens is None
          and dims.q_len <= dims.kv_len):
        o = npu.npu_fusion_attention(q, k, v, dims.heads, dims.layout,
                                     atten_mask=_causal_2048(q.device), scale=scale,
                                     pre_tockens=_BIG, next_tockens=0, sparse_mode=3)[0]
    elif not causal and mask is None and lens is None:
        o = npu.npu_fusion_attention(q, k, v, dims.heads, dims.layout, scale=scale)[0]
    else:
        allow = visible_mask(dims, causal, p.window, mask, lens, q.device)
        o = npu.npu_fusion_attention(q, k, v, dims.heads, dims.layout, atten_mask=~allow,
                                     scale=scale, sparse_mode=0)[0]
        o = _zero_unseen(o, allow, dims.layout)
    return [into_out(out, 0, o)]


# ----------------------------------------------------------------------------- paged


def _fia_paged_reason(p: Any, ins: Mapping[str, Any]) -> str | None:
    q, kc = ins["query"], ins["key_cache"]
    fam = soc_family()
    if fam not in ("A2", "A3"):
        return f"npu_fused_infer_attention_score is documented for A2/A3; SoC family {fam}"
    t, h, d = q.shape
    bs, hkv = kc.shape[1], kc.shape[2]
    if q.dtype not in _HALF:
        return f"npu_fused_infer_attention_score takes fp16/bf16; given {_name(q.dtype)}"
    if bs % 16 or bs > 512:
        return f"paged npu_fused_infer_attention_score decodes block_size % 16 == 0, <= 512; " \
               f"given {bs}"
    if t > 65536 or h > 256 or d > 512 or h // hkv > 64:
        return "npu_fused_infer_attention_score takes B <= 65536, N <= 256, D <= 512, N/Nkv <= 64"
    if hkv * d > 65535:
        return f"paged KV viewed [blocks, block_size, Hkv*D]: Hkv*D {hkv * d} > 64k"
    return None


def _atb_paged_reason(p: Any, ins: Mapping[str, Any]) -> str | None:
    why = nnal_reason() or _nz_reason()
    if why:
        return f"_npu_paged_attention: {why}"
    q, kc = ins["query"], ins["key_cache"]
    bs, d = kc.shape[1], q.shape[2]
    if q.dtype not in _HALF:
        return f"_npu_paged_attention takes fp16/bf16; given {_name(q.dtype)}"
    if bs % 16 or bs > 128 or d > 256:
        return f"_npu_paged_attention takes block_size % 16 == 0, <= 128 and head_dim <= 256; " \
               f"given {bs}, {d}"
    return None


def _nz_reason() -> str | None:
    if soc_family() == "310P":  # vllm-ascend's 310P caches: (2, nblk, Nkv*D//16, bs, 16)
        return "on 310P the ATB cache ops take NZ caches; atb's caches are ND"
    return None


def paged_attention_reasons(p: Any, ins: Mapping[str, Any]) -> str | None:
    """Why no NPU op takes this PagedAttention call: the paged ops reading the
    blocks in place, else FlashAttention's over the gathered rows
    (:mod:`.paged_gather`)."""
    why = unavailable_reason()
    if why:
        return why
    in_place = _in_place_reason(p, ins)
    if in_place is None:
        return None
    gathered = gathered_reason(p, ins)
    return None if gathered is None else f"{in_place}; over gathered rows: {gathered}"


def _in_place_reason(p: Any, ins: Mapping[str, Any]) -> str | None:
    """Why neither paged op reads this call's blocks in place."""
    if ins["query"].shape[0] != ins["block_tables"].shape[0]:  # sum(q_seq_lens) > B
        return "several query tokens per sequence (q_seq_lens): the NPU paged ops decode one"
    if p.window is not None:
        return "sliding window: decode-time pre_tokens is ignored by the NPU paged ops"
    fia = _fia_paged_reason(p, ins)
    if fia is None:
        return None
    atb = _atb_paged_reason(p, ins)
    return None if atb is None else f"{fia}; {atb}"


def _scale(p: Any, d: int) -> float:
    return p.scale if p.scale is not None else 1.0 / math.sqrt(d)


@device_kernel("PagedAttention", "npu", why_not=paged_attention_reasons, provider="torch_npu",
               available=unavailable_reason,
               impl="torch_npu.npu_fused_infer_attention_score with block_table (A2/A3) / "
                    "_npu_paged_attention (NNAL); else FlashAttention's NPU ops over the "
                    "gathered rows (prefill, window, 310P)")
def paged_attention_npu(p: Any, ins: Mapping[str, Any], out: list | None = None) -> list:
    if _in_place_reason(p, ins) is not None:
        return [into_out(out, 0, paged_attention_gathered(p, ins))]
    q, kc, vc = ins["query"], ins["key_cache"], ins["value_cache"]
    t, h, d = q.shape
    nb, bs, hkv = kc.shape[:3]
    tables = ins["block_tables"].to(torch.int32)
    npu = npu_module()
    if _fia_paged_reason(p, ins) is None:
        lens = [int(n) for n in ins["context_lens"].tolist()]  # host ints, as the op takes them
        o, _lse = npu.npu_fused_infer_attention_score(
            q.reshape(t, 1, h * d).contiguous(), kc.view(nb, bs, hkv * d), vc.view(nb, bs, hkv * d),
            actual_seq_lengths_kv=lens, block_table=tables, block_size=bs, num_heads=h,
            num_key_value_heads=hkv, scale=_scale(p, d), input_layout="BSH")
        return [into_out(out, 0, o.view(t, h, d))]
    o = out[0] if out and out[0] is not None else torch.empty_like(q)
    npu._npu_paged_attention(query=q.contiguous(), key_cache=kc, value_cache=vc,
                             num_kv_heads=hkv, num_heads=h, scale_value=_scale(p, d),
                             block_table=tables, context_lens=ins["context_lens"].to("cpu",
                                                                                     torch.int32),
                             out=o)
    return [o]


def reshape_and_cache_reasons(p: Any, ins: Mapping[str, Any]) -> str | None:
    """Why ``_npu_reshape_and_cache`` cannot take this ReshapeAndCache call."""
    why = nnal_reason() or _nz_reason()
    if why:
        return f"_npu_reshape_and_cache: {why}"
    k = ins["key"]
    if k.dtype not in (torch.float16, torch.bfloat16, torch.int8):
        return f"_npu_reshape_and_cache takes fp16/bf16/int8; given {_name(k.dtype)}"
    slots = ins["slot_mapping"]
    if slots.numel() and int(slots.min()) < 0:  # one host read: -1 (skip) is not documented
        return "slot -1 (padding) is not documented for _npu_reshape_and_cache"
    return None


@device_kernel("ReshapeAndCache", "npu", why_not=reshape_and_cache_reasons, provider="torch_npu",
               available=unavailable_reason, impl="torch_npu._npu_reshape_and_cache (NNAL)")
def reshape_and_cache_npu(p: Any, ins: Mapping[str, Any], out: list | None = None) -> list:
    kc, vc = ins["key_cache"], ins["value_cache"]
    npu_module()._npu_reshape_and_cache(key=ins["key"].contiguous(),
                                        value=ins["value"].contiguous(),
                                        key_cache=kc, value_cache=vc,
                                        slot_indices=ins["slot_mapping"].to(torch.int32))
    return [kc, vc]
