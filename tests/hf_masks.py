"""Hugging Face's eager attention masks as the tests' oracle, on every supported
transformers release: ``eager_mask`` takes ``(batch, q_length, kv_length, q_offset=)``
from about 5.2 on and ``(batch, cache_position, kv_length)`` before."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import masking_utils
from transformers.masking_utils import causal_mask_function

__all__ = ["eager_mask"]

_NEW = "q_length" in inspect.signature(masking_utils.eager_mask).parameters


def eager_mask(batch: int, q_length: int, kv_length: int, q_offset: int = 0,
               mask_function: Any = causal_mask_function, **kw: Any) -> torch.Tensor:
    """The additive [batch, 1, q_length, kv_length] mask Hugging Face's eager attention uses."""
    if _NEW:
        return masking_utils.eager_mask(batch, q_length, kv_length, q_offset=q_offset,
                                        mask_function=mask_function, **kw)
    cache_position = torch.arange(q_offset, q_offset + q_length)
    return masking_utils.eager_mask(batch, cache_position, kv_length,
                                    mask_function=mask_function, **kw)
