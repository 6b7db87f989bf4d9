"""Torch kernels for the shape ops. Reshape returns a view of its input; the
others return fresh contiguous tensors (the memory planner treats only Reshape
as an alias of its input)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ...log import logger
from ...runtime.binding import Slot
from ...runtime.native_run import native_call
from ...ops.shape import resolve_shape, slice_bounds, split_sizes
from ...tensor import describe
from . import kernel

__all__ = ["transpose", "reshape", "split", "concat", "slice_"]


def _fresh(t: torch.Tensor) -> torch.Tensor:
    # clone, not contiguous(): contiguous() returns the input itself when it
    # already is contiguous (identity perm, a split along dim 0).
    return t.clone(memory_format=torch.contiguous_format)


@kernel("Transpose", impl="torch.permute + contiguous copy")
def transpose(p, ins):
    return [_fresh(ins["x"].permute(*p.perm))]


def _view(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    try:
        return x.view(shape)
    except RuntimeError as e:
        # Strides that no view can express (e.g. a transposed input): copy once.
        logger.info("Reshape: input strides %s allow no view (%s); copying", x.stride(), e)
        return x.reshape(shape)


def _bind_reshape(p: Any, ins: Mapping[str, Any], outs: list, ctx: Any) -> Any:
    """The view made once for a fixed input, else per run with the shape resolved
    at bind time."""
    x, o = ins["x"], outs[0]
    if type(o) is not Slot:
        return None
    shape, j = tuple(o.desc.shape), o.index
    if type(x) is Slot:
        i = x.index

        def call(env: list) -> None:
            env[j] = _view(env[i], shape)
        return call
    try:
        v = x.view(shape)
    except RuntimeError:  # no view of these strides: a copy per run (one made here
        # would keep the values the buffer held at bind time)
        def copy(env: list) -> None:
            env[j] = x.reshape(shape)
        return copy

    def fixed(env: list) -> None:
        env[j] = v
    fixed.fixed_out = [v]  # type: ignore[attr-defined]  # readers bind to the view itself
    return native_call(fixed)


_bind_reshape.fills_slots = True  # type: ignore[attr-defined]


@kernel("Reshape", impl="torch.Tensor.view (zero-copy)", launches=0, bind=_bind_reshape)
def reshape(p, ins):
    x = ins["x"]
    return [_view(x, resolve_shape("Reshape", p.shape, tuple(x.shape)))]


def _bind_split(p: Any, ins: Mapping[str, Any], outs: list, ctx: Any) -> Any:
    """The parts as views of the input (the planner keeps the input's bytes for as long
    as a part is read): made once for a planned buffer, per run for an input in a
    slot; zero copies. Parts in planned buffers of their own are copied into them."""
    x = ins["x"]
    dim, sizes = split_sizes("Split", p, x.desc if type(x) is Slot else describe(x))
    sizes = list(sizes)
    if all(type(o) is Slot for o in outs):
        idx = [o.index for o in outs]
        if type(x) is not Slot:  # a planned buffer: its parts are views made once
            views = list(torch.split(x, sizes, dim=dim))
            pairs = list(zip(idx, views))

            def fixed_views(env: list) -> None:
                for j, v in pairs:
                    env[j] = v
            fixed_views.fixed_out = views  # type: ignore[attr-defined]  # readers bind to them
            return native_call(fixed_views)
        i = x.index

        def views_per_run(env: list) -> None:
            for j, v in zip(idx, torch.split(env[i], sizes, dim=dim)):
                env[j] = v
        return views_per_run
    if any(type(o) is Slot for o in outs):
        return None
    if type(x) is not Slot:  # parts in buffers of their own: copied
        pairs = list(zip(outs, torch.split(x, sizes, dim=dim)))

        def fixed(env: list) -> None:
            for o, t in pairs:
                o.copy_(t)
        return fixed
    i = x.index

    def call(env: list) -> None:
        for o, t in zip(outs, torch.split(env[i], sizes, dim=dim)):
            o.copy_(t)
    return call


_bind_split.fills_slots = True  # type: ignore[attr-defined]


@kernel("Split", impl="torch.split: views of the input (zero-copy, as Reshape)", launches=0,
        bind=_bind_split)
def split(p, ins):
    x = ins["x"]
    dim, sizes = split_sizes("Split", p, describe(x))
    return list(torch.split(x, list(sizes), dim=dim))


@kernel("Concat", impl="torch.cat")
def concat(p, ins):
    xs = [ins[f"x{i}"] for i in range(len(ins)) if ins.get(f"x{i}") is not None]
    return [torch.cat(xs, dim=p.dim)]


@kernel("Slice", impl="torch slicing + contiguous copy")
def slice_(p, ins):
    x = ins["x"]
    idx = tuple(slice(a, b) for a, b in slice_bounds("Slice", p, tuple(x.shape)))
    return [_fresh(x[idx])]
