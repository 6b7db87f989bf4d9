"""Collective ops: AllReduce.

With one process (no ``torch.distributed`` process group, or a group of size 1)
AllReduce is the identity and returns a copy of its input. When a
``torch.distributed`` process group is initialised, the torch kernel calls
``torch.distributed.all_reduce`` on a copy of the input.

What is tested: only the single-process path (no group, and a gloo group of
world size 1, where ``all_reduce`` really runs but sums one contribution). The
multi-process path has not been run by the test suite; it is a direct call of
``all_reduce``, and it reduces in the tensor's own dtype (no fp32 upcast).

``rank_size`` states how many processes the caller expects; a mismatch with the
actual world size raises :class:`CapabilityError` rather than silently returning
the local tensor as if it were the reduction.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np

from ..errors import CapabilityError
from .base import OpDef, Params
from .registry import register_op

__all__ = ["AllReduceParams", "REDUCE_OPS", "world_size"]

REDUCE_OPS = ("sum", "prod", "max", "min")


def world_size() -> int:
    """Processes in the default ``torch.distributed`` group; 1 when there is none.

    torch is looked up only if something already imported it, so the core stays
    framework-free."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 1
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return int(dist.get_world_size())


@dataclass(frozen=True)
class AllReduceParams(Params):
    """``op`` (alias ``all_reduce_type``, ``reduce_op``): sum (default), prod, max
    or min; ``rank_size`` (alias ``world_size``): expected processes, None = any."""

    ALIASES = {"all_reduce_type": "op", "reduce_op": "op", "world_size": "rank_size"}
    op: str = "sum"
    rank_size: int | None = None

    def validate(self) -> None:
        op = self.op.lower() if isinstance(self.op, str) else self.op
        object.__setattr__(self, "op", op)
        if op not in REDUCE_OPS:
            self.fail("op", " | ".join(REDUCE_OPS), repr(self.op))
        if self.rank_size is not None and (not isinstance(self.rank_size, (int, np.integer))
                                           or self.rank_size < 1):
            self.fail("rank_size", "an integer >= 1 or None", repr(self.rank_size))


@register_op
class AllReduce(OpDef):
    """Reduce ``x`` elementwise across processes; every process gets the result."""

    name = "AllReduce"
    aliases = ("AllReduceOperation",)
    Params = AllReduceParams
    inputs = ("x",)
    outputs = ("y",)

    def infer_shape(self, p, ins):
        n = world_size()
        if p.rank_size is not None and p.rank_size != n:
            raise CapabilityError(self.name, "rank_size does not match the running processes",
                                  f"rank_size {p.rank_size}",
                                  f"world size {n} (torch.distributed "
                                  f"{'initialised' if n > 1 else 'not initialised or size 1'})")
        return [ins["x"]]

    def reference(self, p, ins):
        if world_size() > 1:
            # The NumPy oracle sees one process's data only; it cannot reduce.
            raise CapabilityError(self.name, "the NumPy reference cannot reduce across processes",
                                  "world size 1", world_size())
        return [np.array(ins["x"], copy=True)]
