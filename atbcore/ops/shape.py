"""Shape ops: Transpose, Reshape (a view), Split (views of the input on torch, as
torch.split makes them), Concat, Slice.

Only ``Reshape`` aliases its input (the memory planner lists it in ``VIEW_OPS``);
the others produce fresh, contiguous tensors so a planned buffer never hides
behind another op's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..errors import DtypeError, InputError, ShapeError
from ..tensor import TensorDesc
from .base import OpDef, Params
from .registry import register_op

__all__ = ["TransposeParams", "ReshapeParams", "SplitParams", "ConcatParams", "SliceParams",
           "norm_dim", "resolve_shape", "split_sizes"]


def _ints(v: Any) -> tuple[int, ...] | None:
    if v is None:
        return None
    if isinstance(v, (int, np.integer)):
        return (int(v),)
    return tuple(int(s) for s in v)


def norm_dim(op: str, what: str, dim: int, rank: int, shape: Sequence[int]) -> int:
    """``dim`` in ``[-rank, rank)`` made non-negative, or a :class:`ShapeError`."""
    if not -rank <= dim < rank:
        raise ShapeError(op, f"{what} {dim} out of range for input 'x'",
                         f"a dim in [{-rank}, {rank})", f"shape {list(shape)}")
    return dim % rank


# ----------------------------------------------------------------------------- Transpose


@dataclass(frozen=True)
class TransposeParams(Params):
    """``perm``: a permutation of ``0 .. rank-1`` (required)."""

    perm: Any = None

    def validate(self) -> None:
        perm = _ints(self.perm)
        object.__setattr__(self, "perm", perm)
        if perm is None:
            self.fail("perm (required)", "a permutation of 0..rank-1", None)
        if sorted(perm) != list(range(len(perm))):
            self.fail("perm is not a permutation", f"a permutation of 0..{len(perm) - 1}",
                      list(perm))


@register_op
class Transpose(OpDef):
    """``y = x.permute(perm)``, materialised contiguous."""

    name = "Transpose"
    aliases = ("TransposeOperation", "Permute")
    Params = TransposeParams
    inputs = ("x",)
    outputs = ("y",)

    def infer_shape(self, p, ins):
        x = ins["x"]
        if x.rank != len(p.perm):
            raise ShapeError(self.name, f"input 'x' rank must match perm {list(p.perm)}",
                             f"rank {len(p.perm)}", f"shape {list(x.shape)}")
        return [x.replace(shape=tuple(x.shape[i] for i in p.perm))]

    def reference(self, p, ins):
        return [np.ascontiguousarray(np.transpose(ins["x"], p.perm))]


# ----------------------------------------------------------------------------- Reshape


@dataclass(frozen=True)
class ReshapeParams(Params):
    """``shape``: the new shape; one entry may be ``-1`` (inferred)."""

    ALIASES = {"new_shape": "shape", "dims": "shape"}
    shape: Any = None

    def validate(self) -> None:
        shape = _ints(self.shape)
        object.__setattr__(self, "shape", shape)
        if shape is None:
            self.fail("shape (required)", "a list of sizes", None)
        if any(s < -1 for s in shape) or shape.count(-1) > 1:
            self.fail("shape", "sizes >= 0 with at most one -1", list(shape))


def resolve_shape(op: str, shape: Sequence[int], given: Sequence[int]) -> tuple[int, ...]:
    """``shape`` with its ``-1`` filled in so it holds as many elements as ``given``."""
    numel = int(np.prod(given, dtype=np.int64))
    known = int(np.prod([s for s in shape if s != -1], dtype=np.int64))
    if -1 in shape:
        if known == 0 or numel % known:
            raise ShapeError(op, f"reshape {list(given)} to {list(shape)}: -1 cannot be inferred",
                             f"a multiple of {known} elements", f"{numel} elements")
        return tuple(numel // known if s == -1 else s for s in shape)
    if known != numel:
        raise ShapeError(op, f"reshape size mismatch ({list(given)} to {list(shape)})",
                         f"{known} elements", f"{numel} elements")
    return tuple(shape)


@register_op
class Reshape(OpDef):
    """A view of ``x`` with a new shape: writing into the output changes ``x``
    (torch backend; a copy only when torch cannot express the view)."""

    name = "Reshape"
    aliases = ("ReshapeOperation", "View")
    Params = ReshapeParams
    inputs = ("x",)
    outputs = ("y",)

    def infer_shape(self, p, ins):
        x = ins["x"]
        if -1 in x.shape:  # unknown at plan time (e.g. after Unpad): keep it unknown
            return [x.replace(shape=tuple(p.shape))]
        return [x.replace(shape=resolve_shape(self.name, p.shape, x.shape))]

    def reference(self, p, ins):
        x = ins["x"]
        return [np.reshape(x, resolve_shape(self.name, p.shape, x.shape))]


# ----------------------------------------------------------------------------- Split


@dataclass(frozen=True)
class SplitParams(Params):
    """``dim`` (default -1); ``num`` equal parts or ``sizes`` (one of them)."""

    ALIASES = {"split_dim": "dim", "axis": "dim", "split_num": "num", "split_sizes": "sizes"}
    dim: int = -1
    num: int | None = None
    sizes: Any = None

    def validate(self) -> None:
        sizes = _ints(self.sizes)
        object.__setattr__(self, "sizes", sizes)
        if self.num is None and sizes is None:
            self.fail("num or sizes (one is required)", "num=N or sizes=[...]", None)
        if self.num is not None and (not isinstance(self.num, (int, np.integer)) or self.num < 1):
            self.fail("num", "an integer >= 1", repr(self.num))
        if sizes is not None:
            if not sizes or any(s < 0 for s in sizes):
                self.fail("sizes", "a non-empty list of sizes >= 0", list(sizes))
            if self.num is not None and self.num != len(sizes):
                self.fail("num and sizes disagree", f"num == len(sizes) == {len(sizes)}",
                          self.num)


def split_sizes(op: str, p: SplitParams, x: TensorDesc) -> tuple[int, tuple[int, ...]]:
    """The (normalised dim, piece sizes) of a split of ``x``; ShapeError if they do
    not fit the input."""
    dim = norm_dim(op, "split dim", p.dim, x.rank, x.shape)
    n = x.shape[dim]
    if p.sizes is not None:
        if sum(p.sizes) != n:
            raise ShapeError(op, f"split sizes {list(p.sizes)} must sum to dim {dim} of 'x'",
                             n, f"{sum(p.sizes)} (shape {list(x.shape)})")
        return dim, tuple(p.sizes)
    if n % p.num:
        raise ShapeError(op, f"dim {dim} of 'x' is not divisible into {p.num} equal parts",
                         f"a multiple of {p.num}", f"{n} (shape {list(x.shape)})")
    return dim, (n // p.num,) * p.num


@register_op
class Split(OpDef):
    """``x`` cut along ``dim`` into ``num`` equal parts or pieces of ``sizes``;
    one output per piece."""

    name = "Split"
    aliases = ("SplitOperation",)
    Params = SplitParams
    inputs = ("x",)
    outputs = ("y",)

    def num_outputs(self, p, ins):
        return len(p.sizes) if p.sizes is not None else p.num

    def infer_shape(self, p, ins):
        x = ins["x"]
        if x.rank == 0:
            raise ShapeError(self.name, "input 'x' rank", "rank >= 1", "a scalar")
        dim, sizes = split_sizes(self.name, p, x)
        return [x.replace(shape=x.shape[:dim] + (s,) + x.shape[dim + 1:]) for s in sizes]

    def reference(self, p, ins):
        x = ins["x"]
        dim, sizes = split_sizes(self.name, p, TensorDesc(x.shape, x.dtype))
        cuts = np.cumsum(sizes)[:-1]
        return [np.ascontiguousarray(piece) for piece in np.split(x, cuts, axis=dim)]


# ----------------------------------------------------------------------------- Concat


@dataclass(frozen=True)
class ConcatParams(Params):
    """``dim`` (default -1) to join along."""

    ALIASES = {"concat_dim": "dim", "axis": "dim"}
    dim: int = -1


@register_op
class Concat(OpDef):
    """Join any number (>= 1) of tensors along ``dim``; they are bound as
    ``x0, x1, ...``."""

    name = "Concat"
    aliases = ("ConcatOperation", "Cat")
    Params = ConcatParams
    inputs = ("x0",)
    outputs = ("y",)

    def bind(self, p, items):
        if not items:
            raise InputError(self.name, "number of inputs", "1 or more tensors", 0)
        for i, x in enumerate(items):
            if x is None:
                raise InputError(self.name, f"input 'x{i}' is missing", "a tensor", "None")
        return {f"x{i}": x for i, x in enumerate(items)}

    @staticmethod
    def _items(ins) -> list:
        return [ins[f"x{i}"] for i in range(len(ins)) if ins.get(f"x{i}") is not None]

    def infer_shape(self, p, ins):
        xs = self._items(ins)
        x0 = xs[0]
        if x0.rank == 0:
            raise ShapeError(self.name, "input 'x0' rank", "rank >= 1", "a scalar")
        dim = norm_dim(self.name, "concat dim", p.dim, x0.rank, x0.shape)
        total = 0
        for i, x in enumerate(xs):
            if x.dtype != x0.dtype:
                raise DtypeError(self.name, f"input 'x{i}' dtype must equal 'x0'", x0.dtype.name,
                                 x.dtype.name)
            other = x.shape[:dim] + x.shape[dim + 1:]
            want = x0.shape[:dim] + x0.shape[dim + 1:]
            if x.rank != x0.rank or other != want:
                raise ShapeError(self.name, f"input 'x{i}' shape must match 'x0' except dim {dim}",
                                 f"{list(x0.shape)} (any size at dim {dim})", list(x.shape))
            total += x.shape[dim]
        return [x0.replace(shape=x0.shape[:dim] + (total,) + x0.shape[dim + 1:])]

    def reference(self, p, ins):
        xs = self._items(ins)
        return [np.concatenate(xs, axis=p.dim % xs[0].ndim)]


# ----------------------------------------------------------------------------- Slice


@dataclass(frozen=True)
class SliceParams(Params):
    """``offsets`` (one per dim, negative = from the end) and ``sizes`` (one per
    dim, ``-1`` = to the end)."""

    ALIASES = {"size": "sizes", "begin": "offsets", "starts": "offsets"}
    offsets: Any = None
    sizes: Any = None

    def validate(self) -> None:
        offsets, sizes = _ints(self.offsets), _ints(self.sizes)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "sizes", sizes)
        if offsets is None or sizes is None:
            self.fail("offsets and sizes (both required)", "two lists, one entry per dim",
                      f"offsets={offsets}, sizes={sizes}")
        if len(offsets) != len(sizes):
            self.fail("offsets and sizes lengths differ", len(offsets), len(sizes))
        if any(s < -1 for s in sizes):
            self.fail("sizes", "sizes >= 0 or -1 (to the end)", list(sizes))


def slice_bounds(op: str, p: SliceParams, shape: Sequence[int]) -> list[tuple[int, int]]:
    """(start, stop) per dim; ShapeError when the slice leaves the input."""
    if len(shape) != len(p.offsets):
        raise ShapeError(op, f"input 'x' rank must match offsets {list(p.offsets)}",
                         f"rank {len(p.offsets)}", f"shape {list(shape)}")
    out = []
    for d, (off, size, n) in enumerate(zip(p.offsets, p.sizes, shape)):
        start = off + n if off < 0 else off
        if not 0 <= start <= n:
            raise ShapeError(op, f"offsets[{d}] = {off} out of range for input 'x'",
                             f"an offset in [{-n}, {n}]", f"shape {list(shape)}")
        stop = n if size == -1 else start + size
        if stop > n:
            raise ShapeError(op, f"offsets[{d}] + sizes[{d}] = {start} + {size} past the end of "
                             f"input 'x'", f"<= {n}", f"shape {list(shape)}")
        out.append((start, stop))
    return out


@register_op
class Slice(OpDef):
    """``x[offsets : offsets + sizes]`` per dim (``-1`` size = to the end)."""

    name = "Slice"
    aliases = ("SliceOperation",)
    Params = SliceParams
    inputs = ("x",)
    outputs = ("y",)

    def infer_shape(self, p, ins):
        x = ins["x"]
        bounds = slice_bounds(self.name, p, x.shape)
        return [x.replace(shape=tuple(b - a for a, b in bounds))]

    def reference(self, p, ins):
        x = ins["x"]
        idx = tuple(slice(a, b) for a, b in slice_bounds(self.name, p, x.shape))
        return [np.ascontiguousarray(x[idx])]
