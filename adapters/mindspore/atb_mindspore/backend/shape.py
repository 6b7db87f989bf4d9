"""MindSpore kernels for the shape ops. Reshape returns a view of its input; the
others return fresh contiguous tensors (the memory planner treats only Reshape as
an alias of its input), so a result never shares memory with an input."""

from __future__ import annotations

from typing import Any

from atbcore.log import logger
from atbcore.runtime.binding import view_binder
from atbcore.ops.shape import resolve_shape, slice_bounds, split_sizes
from atbcore.tensor import describe

from .._env import device_name
from .._env import mindspore as _ms
from . import kernel
from .common import mint

__all__ = ["fresh"]


def fresh(t: Any) -> Any:
    """A contiguous tensor owning its memory (``contiguous()`` alone returns the
    input itself when it already is contiguous)."""
    return t.copy() if t.is_contiguous() else t.contiguous()


@kernel("Transpose", impl="mindspore mint.permute + contiguous copy")
def transpose(p, ins):
    return [fresh(mint().permute(ins["x"], tuple(p.perm)))]


# the MindSpore view of a planned buffer made once (readers bind to it), per run for a slot
_bind_reshape = view_binder(lambda p, ins: reshape(p, ins))


@kernel("Reshape", impl="a NumPy view as a MindSpore tensor, or Tensor.view (zero-copy); "
        "made once for a planned buffer", launches=0, bind=_bind_reshape)
def reshape(p, ins):
    x = ins["x"]
    a = getattr(x, "_atb_array", None)  # a tensor atb made over a NumPy array
    if a is not None:
        from .native import host_tensor

        return [host_tensor(a.reshape(resolve_shape("Reshape", p.shape, a.shape)))]
    shape = resolve_shape("Reshape", p.shape, tuple(x.shape))
    if x.is_contiguous():
        if x.dtype != _ms().bfloat16 and device_name(x) == "cpu":
            # the same memory through NumPy: Tensor.view is a PyNative op dispatched
            # asynchronously, which the C kernels reading it next must wait for
            from .native import host_tensor

            a = x.asnumpy()
            if a.ctypes.data == getattr(x, "_atb_address", None) or \
                    a.ctypes.data == x.data_ptr():
                return [host_tensor(a.reshape(shape))]
        return [x.view(shape)]
    logger.info("Reshape: a non-contiguous MindSpore input allows no view; copying")
    return [x.contiguous().view(shape)]


@kernel("Split", impl="mindspore mint.split + contiguous copies")
def split(p, ins):
    x = ins["x"]
    dim, sizes = split_sizes("Split", p, describe(x))
    return [fresh(t) for t in mint().split(x, list(sizes), dim)]


@kernel("Concat", impl="mindspore mint.cat")
def concat(p, ins):
    xs = [ins[f"x{i}"] for i in range(len(ins)) if ins.get(f"x{i}") is not None]
    if len(xs) == 1:
        return [fresh(xs[0])]
    return [mint().cat(xs, p.dim)]


@kernel("Slice", impl="mindspore slicing + contiguous copy")
def slice_(p, ins):
    x = ins["x"]
    idx = tuple(slice(a, b) for a, b in slice_bounds("Slice", p, tuple(x.shape)))
    return [fresh(x[idx])]
