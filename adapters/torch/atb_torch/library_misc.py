"""``torch.ops.atb.*`` for elementwise, shape, gather/embedding, argmax/sampling and
all-reduce ops. Same rules as :mod:`atb_torch.library`.

Reshape is not here: it is a view, and a custom op may not return a view of its
input; ``atb_torch.functional.reshape`` validates with the core and calls
``Tensor.reshape`` instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

from atbcore.dtypes import Dtype

from .library import _opt, call_kernel, register

__all__ = ["residual_add", "elewise", "transpose", "split", "concat", "slice_", "gather",
           "embedding", "argmax", "topk_topp_sampling", "all_reduce"]


# ----------------------------------------------------------------------------- elementwise


@register("residual_add", "ResidualAdd")
def residual_add(x: Tensor, residual: Tensor) -> Tensor:
    return call_kernel("ResidualAdd", {}, x=x, residual=residual)[0]


@residual_add.register_fake
def _(x, residual):
    return torch.empty_like(x)


@register("elewise", "Elewise")
def elewise(x: Tensor, y: Tensor | None = None, elewise_type: str = "add", scalar: float = 1.0,
            out_dtype: str = "") -> Tensor:
    """add/sub/mul/div (broadcasting), muls (by ``scalar``), neg, cast (to
    ``out_dtype``, a Dtype name such as "bf16"), cos, sin, tanh, exp, rsqrt."""
    params = {"elewise_type": elewise_type, "scalar": scalar, "out_dtype": _opt(out_dtype, "")}
    return call_kernel("Elewise", params, x=x, y=y)[0]


@elewise.register_fake
def _(x, y=None, elewise_type="add", scalar=1.0, out_dtype=""):
    if y is not None:
        return torch.empty(torch.broadcast_shapes(x.shape, y.shape), dtype=x.dtype,
                           device=x.device)
    if out_dtype:
        return x.new_empty(x.shape, dtype=Dtype.of(out_dtype).torch)
    return torch.empty_like(x)


# ----------------------------------------------------------------------------- shape


@register("transpose", "Transpose")
def transpose(x: Tensor, perm: list[int]) -> Tensor:
    """``x.permute(perm)`` as a fresh contiguous tensor."""
    return call_kernel("Transpose", {"perm": tuple(perm)}, x=x)[0]


@transpose.register_fake
def _(x, perm):
    return x.permute(*perm).contiguous()


@register("split", "Split")
def split(x: Tensor, sizes: list[int], dim: int = -1) -> list[Tensor]:
    """Pieces of the given ``sizes`` along ``dim`` (fresh tensors)."""
    return call_kernel("Split", {"sizes": tuple(sizes), "dim": dim}, x=x)


@split.register_fake
def _(x, sizes, dim=-1):
    return [t.contiguous() for t in torch.split(x, list(sizes), dim=dim)]


@register("concat", "Concat")
def concat(xs: list[Tensor], dim: int = -1) -> Tensor:
    return call_kernel("Concat", {"dim": dim}, **{f"x{i}": x for i, x in enumerate(xs)})[0]


@concat.register_fake
def _(xs, dim=-1):
    return torch.cat(xs, dim=dim)


@register("slice", "Slice")
def slice_(x: Tensor, offsets: list[int], sizes: list[int]) -> Tensor:
    """``x[offsets : offsets + sizes]`` per dim (size -1 = to the end), fresh."""
    return call_kernel("Slice", {"offsets": tuple(offsets), "sizes": tuple(sizes)}, x=x)[0]


@slice_.register_fake
def _(x, offsets, sizes):
    idx = []
    for off, size, n in zip(offsets, sizes, x.shape):
        start = off + n if off < 0 else off
        idx.append(slice(start, None if size == -1 else start + size))
    return x[tuple(idx)].contiguous()


# ----------------------------------------------------------------------------- gather


@register("gather", "Gather")
def gather(x: Tensor, indices: Tensor, axis: int = 0) -> Tensor:
    """``take(x, indices, axis)``; out-of-range indices raise InputError."""
    return call_kernel("Gather", {"axis": axis}, x=x, indices=indices)[0]


@gather.register_fake
def _(x, indices, axis=0):
    a = axis % x.dim()
    return x.new_empty((*x.shape[:a], *indices.shape, *x.shape[a + 1:]))


@register("embedding", "Embedding")
def embedding(weight: Tensor, ids: Tensor) -> Tensor:
    """``weight[ids]``; ids out of range raise InputError (not an index crash)."""
    return call_kernel("Embedding", {}, weight=weight, ids=ids)[0]


@embedding.register_fake
def _(weight, ids):
    return weight.new_empty((*ids.shape, weight.shape[-1]))


# ----------------------------------------------------------------------------- argmax, sampling


@register("argmax", "Argmax")
def argmax(x: Tensor, dim: int = -1, keepdim: bool = False) -> Tensor:
    return call_kernel("Argmax", {"dim": dim, "keepdim": keepdim}, x=x)[0]


@argmax.register_fake
def _(x, dim=-1, keepdim=False):
    return torch.argmax(x, dim=dim, keepdim=keepdim)


@register("topk_topp_sampling", "TopkToppSampling")
def topk_topp_sampling(logits: Tensor, top_k: int = 0, top_p: float = 1.0,
                       temperature: float = 1.0, seed: int = 0) -> Tensor:
    """Seeded top-k/top-p sampling: logits [B, V] -> ids int64 [B]."""
    params = {"top_k": top_k, "top_p": top_p, "temperature": temperature, "seed": seed}
    return call_kernel("TopkToppSampling", params, logits=logits)[0]


@topk_topp_sampling.register_fake
def _(logits, top_k=0, top_p=1.0, temperature=1.0, seed=0):
    return logits.new_empty(logits.shape[:-1], dtype=torch.int64)


# ----------------------------------------------------------------------------- collective


@register("all_reduce", "AllReduce")
def all_reduce(x: Tensor, op: str = "sum", rank_size: int = 0) -> Tensor:
    """Sum (or max/min/prod) across the default process group; identity in one process."""
    return call_kernel("AllReduce", {"op": op, "rank_size": _opt(rank_size, 0)}, x=x)[0]


@all_reduce.register_fake
def _(x, op="sum", rank_size=0):
    return torch.empty_like(x)
