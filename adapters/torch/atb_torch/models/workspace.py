"""Reused buffers for long CPU prefills (:class:`Workspace`)."""

from __future__ import annotations

import torch

from atbcore.memory import hugepages

__all__ = ["Workspace"]


class Workspace:
    """A runner's reusable prefill buffers, on huge pages: a name's buffer grows to
    the largest request and the next layer takes it again, so a long prefill's big
    intermediates (merged QKV, gate/up, the activation) are not allocated, page-faulted
    and freed layer after layer (the batch prefill of 4,224 tokens spent ~0.1 s of its
    1.25 s in page faults). Callers take a name only for a tensor that dies within
    the layer; :meth:`release` gives the memory back."""

    def __init__(self) -> None:
        self.bufs: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= int(d)
        n *= dtype.itemsize
        buf = self.bufs.get(name)
        if buf is None or buf.numel() < n:
            self.bufs.pop(name, None)                 # the old one goes before the new one
            buf = self.bufs[name] = hugepages.empty((n,), torch.uint8)
        return buf[:n].view(dtype).view(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.bufs.values())

    def release(self) -> None:
        self.bufs.clear()
