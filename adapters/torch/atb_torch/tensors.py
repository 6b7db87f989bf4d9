"""Tensors from other frameworks enter atb_torch through DLPack.

    y = atb.functional.rms_norm(np_array, paddle_weight)   # torch tensors out

NumPy arrays, MindSpore and Paddle tensors are converted with
:func:`atbcore.tensor.convert` (zero-copy where the producer allows it); torch
tensors pass through untouched, so under ``torch.compile`` this is a no-op.
"""

from __future__ import annotations

from typing import Any

import torch

from atbcore.errors import InputError
from atbcore.tensor import convert, is_tensor

__all__ = ["as_torch", "as_torch_opt"]


def as_torch(x: Any, op: str = "atb_torch", what: str = "input") -> torch.Tensor:
    """``x`` as a torch tensor: torch passes through; numpy / mindspore / paddle
    tensors cross through DLPack. Anything else is an :class:`InputError`."""
    if isinstance(x, torch.Tensor):
        return x
    if is_tensor(x):
        return convert(x, "torch")
    raise InputError(op, f"{what} type", "a torch tensor or a numpy/mindspore/paddle tensor",
                     type(x).__name__)


def as_torch_opt(x: Any, op: str = "atb_torch", what: str = "input") -> torch.Tensor | None:
    """:func:`as_torch` that lets ``None`` through (absent optional inputs)."""
    return None if x is None else as_torch(x, op, what)
