"""Allocators of a bound program's fresh output tensors (see :mod:`.binding`)."""

from __future__ import annotations

from typing import Any, Callable

from ..errors import AtbError
from ..tensor import TensorDesc

__all__ = ["empty_allocator"]


def empty_allocator(native: str, desc: TensorDesc) -> Callable[[], Any]:
    """``() -> tensor``: a fresh, uninitialised ``native`` tensor (torch or NumPy) of
    ``desc`` per call (a bound program's output slots are filled with these)."""
    shape = tuple(desc.shape)
    if native == "torch":
        import torch

        # empty_like of a stride-0 view of one element: the shape, dtype and device
        # without parsing them per call (about half the time of torch.empty(shape, ...))
        like = torch.empty((), dtype=desc.dtype.torch, device=desc.device).expand(shape)
        fmt = torch.contiguous_format
        return lambda: torch.empty_like(like, memory_format=fmt)
    if native == "numpy":
        import numpy as np

        dt = desc.dtype.numpy
        return lambda: np.empty(shape, dtype=dt)
    raise AtbError("plan", f"no allocator for {native} tensors", "torch or numpy", native)
