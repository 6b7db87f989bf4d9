"""``attn_implementation="atb"``: atb's FlashAttention inside Hugging Face models.

Registered with transformers' ``AttentionInterface`` (and, for the masks it builds,
``AttentionMaskInterface``, with SDPA's boolean masks) when this module is imported
(``atb_torch.models`` itself does not import transformers)::

    import atb_torch.models.hf_attention  # registers "atb"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="atb")
    model.set_attn_implementation("atb")             # or on a loaded model

The model stays Hugging Face's (its cache, its generate); each attention layer calls
``torch.ops.atb.flash_attention`` (GQA without repeating K/V, causal or the given
boolean mask, sliding windows through the mask), so ``torch.compile`` can trace it;
an eager decode step on the CPU (one query row) calls the op's C decode attention
directly, its output already in the layout Hugging Face asks for.
What it does not implement (attention weights, soft-capping, attention sinks, dropout
while training) raises :class:`~atbcore.errors.CapabilityError` naming the option.
"""

from __future__ import annotations

from typing import Any

import torch

from atbcore.backends.torch.attention import decode_bnsd
from atbcore.errors import CapabilityError

__all__ = ["atb_attention_forward", "register_attention"]

NAME = "atb"


def atb_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: torch.Tensor | None,
                          dropout: float = 0.0, scaling: float | None = None,
                          is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Hugging Face's attention-function contract: q ``[B, H, Sq, D]``, k/v
    ``[B, Hkv, Skv, D]``, the mask from SDPA's mask builder (bool, True = attend, or
    None); returns (``[B, Sq, H, D]``, None)."""
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise CapabilityError("attn_implementation='atb'", name, "None", "a value")
    if kwargs.get("output_attentions"):
        raise CapabilityError("attn_implementation='atb'", "output_attentions", "False "
                              "(atb does not materialise attention weights; use 'eager')", True)
    if dropout and module.training:
        raise CapabilityError("attn_implementation='atb'", "dropout while training",
                              "0.0 or eval mode", dropout)
    q_len, kv_len = query.shape[2], key.shape[2]
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    if q_len == 1 and query.is_cpu and not _traced_or_grad(query, key, value):
        # a decode step: the C decode attention, without the op's dispatch
        out = decode_bnsd(query, key, value, scale=scale, mask=attention_mask)
        if out is not None:                                     # [B, H, 1, D] contiguous
            return out.view(out.shape[0], 1, out.shape[1], out.shape[3]), None
    from .. import library  # noqa: F401  (registers torch.ops.atb.*)

    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # as SDPA: without a mask, a multi-token query is causal (a single one sees all)
    causal = bool(q_len > 1 and attention_mask is None and causal)
    if causal and kv_len > q_len:  # an empty preallocated cache: the tail is not filled yet
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = torch.ops.atb.flash_attention(
        query, key, value, attention_mask, None, num_heads=query.shape[1],
        num_kv_heads=key.shape[1], scale=scale, causal=causal, layout="BNSD")  # [B, H, Sq, D]
    return out.transpose(1, 2).contiguous(), None                      # [B, Sq, H, D]


def _traced_or_grad(*xs: torch.Tensor) -> bool:
    """True under ``torch.compile``'s tracing (which must see the custom op) or when
    autograd records (the op refuses a backward; a direct call would drop it)."""
    if torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and any(x.requires_grad for x in xs)


def register_attention() -> None:
    """Register ``"atb"`` with transformers' attention and attention-mask interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, atb_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)

register_attention()
