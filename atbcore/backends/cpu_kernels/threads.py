"""The C kernels' thread count, and parking torch's intra-op pool around steps that
run them (see :class:`parked_torch_threads`)."""

from __future__ import annotations

import torch

__all__ = ["parked_torch_threads", "pool_threads"]

# The C pool's thread count while torch's own intra-op pool is parked at one thread
# (see parked_torch_threads); 0 = follow torch.get_num_threads().
_POOL_THREADS = [0]


def pool_threads() -> int:
    """How many threads the C kernels' pool may use now."""
    return _POOL_THREADS[0] or torch.get_num_threads()


class parked_torch_threads:
    """``with parked_torch_threads(): ...`` runs the block with torch's intra-op pool at
    one thread while the C kernels' pool keeps the count torch had.

    torch's OpenMP workers spin for a while after each parallel region; on a machine
    with as many cores as threads a spinning worker holds the core the C pool's worker
    needs, so a few-row matmul that follows any parallel torch op ran at one core's
    bandwidth (measured: the 32000x512 fp32 LM head 3.1 ms after an SDPA, 1.9 ms
    alone). Decode steps made of C matmuls and small torch ops run parked."""

    __slots__ = ("n",)

    def __enter__(self) -> "parked_torch_threads":
        self.n = torch.get_num_threads()
        if self.n > 1 and not _POOL_THREADS[0]:
            _POOL_THREADS[0] = self.n
            torch.set_num_threads(1)
        else:
            self.n = 0                      # nested or single-threaded: nothing to undo
        return self

    def __exit__(self, *exc: object) -> None:
        if self.n:
            torch.set_num_threads(self.n)
            _POOL_THREADS[0] = 0
