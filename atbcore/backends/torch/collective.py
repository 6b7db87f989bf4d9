"""Torch kernels of the collectives and LinearParallel on ``torch.distributed``
(gloo, nccl or hccl: whatever backend the group was created with; see
:mod:`atbcore.distributed.groups`). Without an initialised group each is its
one-rank case. Inputs are never modified; outputs are fresh tensors."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...distributed.groups import resolve_group
from . import kernel

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all",
           "linear_parallel", "vocab_parallel_embedding"]

DEVICES = ("cpu", "cuda", "npu")


def _reduce_op(name: str):
    return {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN}[name]


def _group(p):
    """(process group or None, ranks); ranks 0 when torch.distributed is not
    initialised (the one-rank case runs without any collective call; an
    initialised group of one still calls it)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, 0
    pg = resolve_group(p.group, type(p).OP)
    return pg, dist.get_world_size(pg)


def _all_reduce_into(y, op, pg, n):
    if n:
        dist.all_reduce(y, op=_reduce_op(op), group=pg)
    return y


@kernel("AllReduce", impl="torch.distributed.all_reduce on a copy", devices=DEVICES)
def all_reduce(p, ins):
    pg, n = _group(p)
    return [_all_reduce_into(ins["x"].clone(), p.op, pg, n)]  # never reduced in place


# torch 2.13 renamed the tensor forms (the old names warn); older torch has only those
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather(x, pg, n):
    """[n, *x.shape]: every rank's x in rank order."""
    out = torch.empty((max(n, 1), *x.shape), dtype=x.dtype, device=x.device)
    if not n:
        return out.copy_(x.unsqueeze(0))
    # flat on the wire: backends split the output's dim 0 into the ranks' inputs
    _ALL_GATHER(out.view(-1), x.contiguous().view(-1), group=pg)
    return out


@kernel("AllGather", impl="torch.distributed all-gather into one tensor", devices=DEVICES,
        launches=2)
def all_gather(p, ins):
    pg, n = _group(p)
    stacked = _gather(ins["x"], pg, n)
    if p.axis is None:
        return [stacked]
    return [torch.cat(stacked.unbind(0), dim=p.axis)]


def _scatter_reduced(y, op, axis, pg, n):
    """Chunk ``rank`` of ``all_reduce(y)`` along ``axis`` (``y`` may be consumed)."""
    moved = y.movedim(axis, 0).contiguous()  # reduce_scatter_tensor splits dim 0
    out = torch.empty((moved.shape[0] // max(n, 1), *moved.shape[1:]), dtype=y.dtype,
                      device=y.device)
    if not n:
        out.copy_(moved)
    else:
        _REDUCE_SCATTER(out, moved, op=_reduce_op(op), group=pg)
    return out.movedim(0, axis).contiguous()


@kernel("ReduceScatter", impl="torch.distributed reduce-scatter into one tensor", devices=DEVICES,
        launches=3)
def reduce_scatter(p, ins):
    pg, n = _group(p)
    return [_scatter_reduced(ins["x"], p.op, p.axis, pg, n)]


@kernel("Broadcast", impl="torch.distributed.broadcast on a copy", devices=DEVICES)
def broadcast(p, ins):
    pg, n = _group(p)
    y = ins["x"].clone()
    if n:
        dist.broadcast(y, group=pg, group_src=p.root)
    return [y]


@kernel("AllToAll", impl="torch.distributed.all_to_all_single", devices=DEVICES, launches=3)
def all_to_all(p, ins):
    pg, n = _group(p)
    moved = ins["x"].movedim(p.axis, 0).contiguous()  # all_to_all_single splits dim 0
    out = torch.empty_like(moved)
    if not n:
        out.copy_(moved)
    else:
        dist.all_to_all_single(out, moved, group=pg)
    return [out.movedim(0, p.axis).contiguous()]


@kernel("LinearParallel", impl="fp32 matmul fused with its torch.distributed collective",
        devices=DEVICES, launches=2)
def linear_parallel(p, ins):
    pg, n = _group(p)
    x, w, b = ins["x"], ins["weight"], ins["bias"]
    w = w if p.transpose_weight else w.t()
    if p.type == "all_gather_linear":
        x = _gather(x, pg, n).flatten(0, 1)  # [n*T, ...]: ranks' tokens in rank order
    y = torch.nn.functional.linear(x.float(), w.float())  # fp32 partial products
    if p.type == "linear_all_reduce":
        y = _all_reduce_into(y, "sum", pg, n)
    elif p.type == "linear_reduce_scatter":
        y = _scatter_reduced(y, "sum", 0, pg, n)
    if b is not None:
        y = y.add_(b)
    return [y.to(ins["x"].dtype)]


@kernel("VocabParallelEmbedding", impl="masked F.embedding + torch.distributed.all_reduce",
        devices=DEVICES, launches=7)
def vocab_parallel_embedding(p, ins):
    pg, n = _group(p)
    w = ins["weight"]
    rows = w.shape[0]
    rank = dist.get_rank(pg) if n else 0
    local = ins["ids"].long() - rank * rows  # this rank's rows: [0, rows)
    miss = (local < 0) | (local >= rows)
    y = torch.nn.functional.embedding(local.clamp(0, rows - 1), w)
    y.masked_fill_(miss.unsqueeze(-1), 0)
    return [_all_reduce_into(y, "sum", pg, n)]
