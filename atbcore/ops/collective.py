"""Collective ops across the processes of a ``torch.distributed`` group:
AllReduce, AllGather, ReduceScatter, Broadcast and AllToAll (LinearParallel, a
matmul fused with one of them, is in :mod:`.linear_parallel`).

Every collective takes ``group`` (None = the default group, a ProcessGroup, or a
name given to :func:`atbcore.distributed.register_group`) and ``rank_size`` (the
processes the caller expects; a mismatch with the group raises
:class:`CapabilityError` rather than returning one process's data as if it were
the result). Without an initialised group there is one process: each op is then
exactly its one-rank case (a copy, AllGather stacks one tensor).

The NumPy reference of a collective needs every rank's inputs:
``opdef.reference_ranks(params, [ins_of_rank0, ins_of_rank1, ...])`` returns every
rank's outputs; the tests feed it the seeded inputs of all ranks and compare each
process's kernel output with its rank's share. ``reference(params, ins)`` (the
single-process oracle) is the one-rank case. Reductions run in the tensor's own
dtype on the wire; the reference reduces in float64 and rounds once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..distributed.groups import group_size
from ..errors import CapabilityError, ShapeError
from ..tensor import TensorDesc
from .base import OpDef, Params
from .registry import register_op

__all__ = ["AllReduceParams", "AllGatherParams", "ReduceScatterParams", "BroadcastParams",
           "AllToAllParams", "CollectiveOp", "REDUCE_OPS", "world_size", "reduce_arrays"]

REDUCE_OPS = ("sum", "prod", "max", "min")


def world_size() -> int:
    """Processes in the default ``torch.distributed`` group; 1 when there is none."""
    return group_size(None)


def reduce_arrays(op: str, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Elementwise ``op`` over equal-shaped arrays, float64 (int64 for ints), then
    rounded once to the inputs' dtype."""
    dtype = np.asarray(arrays[0]).dtype
    wide = np.int64 if dtype.kind in "biu" else np.float64
    stack = np.stack([np.asarray(a).astype(wide) for a in arrays])
    fn = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}[op]
    return fn(stack, axis=0).astype(dtype)


@dataclass(frozen=True)
class CollectiveParams(Params):
    """Shared by every collective: ``group`` and ``rank_size`` (module docstring)."""

    group: Any = None
    rank_size: int | None = None

    def validate(self) -> None:
        g = self.group
        if not (g is None or (isinstance(g, str) and g)
                or (callable(getattr(g, "size", None)) and callable(getattr(g, "rank", None)))):
            self.fail("group", "None, a registered group name or a ProcessGroup", repr(g))
        if self.rank_size is not None and self.rank_size < 1:
            self.fail("rank_size", "an integer >= 1 or None", repr(self.rank_size))


def _reduce_op(p: Params, field: str = "op") -> None:
    op = getattr(p, field)
    op = op.lower() if isinstance(op, str) else op
    object.__setattr__(p, field, op)
    if op not in REDUCE_OPS:
        p.fail(field, " | ".join(REDUCE_OPS), repr(op))


class CollectiveOp(OpDef):
    """Base of the collectives: checks ``rank_size`` against the group and turns
    :meth:`reference_ranks` into the single-process reference. Each call talks to the
    other ranks, so none is ever merged away (``effectful``)."""

    effectful = True

    def ranks(self, p: Params) -> int:
        """Processes in the op's group; CapabilityError when ``rank_size`` disagrees."""
        n = group_size(p.group, self.name)
        if p.rank_size is not None and p.rank_size != n:
            raise CapabilityError(self.name, "rank_size does not match the running processes",
                                  f"rank_size {p.rank_size}",
                                  f"world size {n} (torch.distributed "
                                  f"{'initialised' if n > 1 else 'not initialised or size 1'})")
        return n

    def reference_ranks(self, p: Params, per_rank: Sequence[Mapping[str, Any]]
                        ) -> list[list[np.ndarray]]:
        """Every rank's outputs from every rank's inputs (``per_rank[r]`` by name)."""
        raise NotImplementedError

    def reference(self, p, ins):
        n = self.ranks(p)
        if n > 1:
            # One process's data alone cannot give the result; reference_ranks can.
            raise CapabilityError(self.name, "the NumPy reference sees one process's inputs; "
                                  "use reference_ranks with every rank's inputs",
                                  "world size 1", n)
        return self.reference_ranks(p, [ins])[0]


def _axis(op: str, axis: int, d: TensorDesc) -> int:
    if not -d.rank <= axis < d.rank:
        raise ShapeError(op, f"axis {axis} out of range for input 'x'",
                         f"a dim in [{-d.rank}, {d.rank})", f"shape {list(d.shape)}")
    return axis % d.rank


def _divisible(op: str, d: TensorDesc, axis: int, n: int) -> None:
    if d.shape[axis] % n:
        raise ShapeError(op, f"input 'x' dim {axis} must split evenly over {n} ranks",
                         f"a multiple of {n}", f"{d.shape[axis]} (shape {list(d.shape)})")


# ----------------------------------------------------------------------------- AllReduce
@dataclass(frozen=True)
class AllReduceParams(CollectiveParams):
    """``op`` (alias ``all_reduce_type``, ``reduce_op``): sum (default), prod, max
    or min; ``rank_size`` (alias ``world_size``); ``group``."""

    ALIASES = {"all_reduce_type": "op", "reduce_op": "op", "world_size": "rank_size"}
    op: str = "sum"

    def validate(self) -> None:
        _reduce_op(self)
        super().validate()


@register_op
class AllReduce(CollectiveOp):
    """Reduce ``x`` elementwise across processes; every process gets the result."""

    name = "AllReduce"
    aliases = ("AllReduceOperation",)
    Params = AllReduceParams
    inputs = ("x",)
    outputs = ("y",)

    def infer_shape(self, p, ins):
        self.ranks(p)
        return [ins["x"]]

    def reference_ranks(self, p, per_rank):
        y = reduce_arrays(p.op, [ins["x"] for ins in per_rank])
        return [[y.copy()] for _ in per_rank]


# ----------------------------------------------------------------------------- AllGather
@dataclass(frozen=True)
class AllGatherParams(CollectiveParams):
    """``axis``: None (default, ATB's layout) stacks the ranks' tensors on a new
    leading dim ``[ranks, *x.shape]``; an int concatenates them along that dim."""

    ALIASES = {"world_size": "rank_size", "dim": "axis"}
    axis: int | None = None


@register_op
class AllGather(CollectiveOp):
    """Every process gets every process's ``x``, in rank order."""

    name = "AllGather"
    aliases = ("AllGatherOperation",)
    Params = AllGatherParams
    inputs = ("x",)
    outputs = ("y",)

    def infer_shape(self, p, ins):
        n, d = self.ranks(p), ins["x"]
        if p.axis is None:
            return [TensorDesc((n, *d.shape), d.dtype, d.device)]
        a = _axis(self.name, p.axis, d)
        shape = list(d.shape)
        shape[a] *= n
        return [TensorDesc(tuple(shape), d.dtype, d.device)]

    def reference_ranks(self, p, per_rank):
        xs = [np.asarray(ins["x"]) for ins in per_rank]
        y = np.stack(xs) if p.axis is None else np.concatenate(xs, axis=p.axis)
        return [[y.copy()] for _ in per_rank]


# ------------------------------------------------------------------------- ReduceScatter
@dataclass(frozen=True)
class ReduceScatterParams(CollectiveParams):
    """``op``: sum (default), prod, max, min; ``axis`` (default 0): the dim split
    into one equal chunk per rank after the reduction."""

    ALIASES = {"reduce_type": "op", "reduce_op": "op", "world_size": "rank_size", "dim": "axis"}
    op: str = "sum"
    axis: int = 0

    def validate(self) -> None:
        _reduce_op(self)
        super().validate()


@register_op
class ReduceScatter(CollectiveOp):
    """Reduce ``x`` across processes; rank r keeps chunk r of the result along ``axis``."""

    name = "ReduceScatter"
    aliases = ("ReduceScatterOperation",)
    Params = ReduceScatterParams
    inputs = ("x",)
    outputs = ("y",)

    def infer_shape(self, p, ins):
        n, d = self.ranks(p), ins["x"]
        a = _axis(self.name, p.axis, d)
        _divisible(self.name, d, a, n)
        shape = list(d.shape)
        shape[a] //= n
        return [TensorDesc(tuple(shape), d.dtype, d.device)]

    def reference_ranks(self, p, per_rank):
        y = reduce_arrays(p.op, [ins["x"] for ins in per_rank])
        return [[c.copy()] for c in np.split(y, len(per_rank), axis=p.axis)]


# ----------------------------------------------------------------------------- Broadcast
@dataclass(frozen=True)
class BroadcastParams(CollectiveParams):
    """``root`` (alias ``rank_root``, ``src``): the rank in the group whose ``x``
    every process gets."""

    ALIASES = {"rank_root": "root", "src": "root", "world_size": "rank_size"}
    root: int = 0

    def validate(self) -> None:
        if self.root < 0:
            self.fail("root", "a rank >= 0", repr(self.root))
        super().validate()


@register_op
class Broadcast(CollectiveOp):
    """Every process gets the ``root`` process's ``x`` (shapes must agree)."""

    name = "Broadcast"
    aliases = ("BroadcastOperation",)
    Params = BroadcastParams
    inputs = ("x",)
    outputs = ("y",)

    def infer_shape(self, p, ins):
        n = self.ranks(p)
        if p.root >= n:
            raise CapabilityError(self.name, "root is not a rank of the group",
                                  f"a rank in [0, {n})", p.root)
        return [ins["x"]]

    def reference_ranks(self, p, per_rank):
        y = np.asarray(per_rank[p.root]["x"])
        return [[y.copy()] for _ in per_rank]


# ------------------------------------------------------------------------------ AllToAll
@dataclass(frozen=True)
class AllToAllParams(CollectiveParams):
    """``axis`` (default 0): ``x`` is split along it into one chunk per rank; chunk
    j goes to rank j, and each rank concatenates what it got, in rank order."""

    ALIASES = {"world_size": "rank_size", "dim": "axis"}
    axis: int = 0


@register_op
class AllToAll(CollectiveOp):
    """Rank r's output is chunk r of every rank's ``x``, concatenated along ``axis``."""

    name = "AllToAll"
    aliases = ("AllToAllOperation",)
    Params = AllToAllParams
    inputs = ("x",)
    outputs = ("y",)

    def infer_shape(self, p, ins):
        n, d = self.ranks(p), ins["x"]
        _divisible(self.name, d, _axis(self.name, p.axis, d), n)
        return [d]

    def reference_ranks(self, p, per_rank):
        n = len(per_rank)
        chunks = [np.split(np.asarray(ins["x"]), n, axis=p.axis) for ins in per_rank]
        return [[np.concatenate([chunks[j][r] for j in range(n)], axis=p.axis)]
                for r in range(n)]
