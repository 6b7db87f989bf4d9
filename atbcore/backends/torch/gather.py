"""Torch kernels for Gather (index_select) and Embedding (F.embedding). Index
ranges were checked by the op's ``check_values`` before these run — except in a
bound CPU Embedding, which writes its rows into its planned buffer with one
row gather and checks the ids only when that refuses them (a decode step's
first node: a separate min/max pass and a copy cost more than the lookup). Bound on
the CPU, both run the C row gather (:mod:`..cpu_kernels.torch_gather`: a torch op's
dispatch costs more than the one row a decode step gathers), else ``index_select``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ...ops.gather import check_index_range
from ...runtime.binding import Slot, getter
from ...runtime.native_run import native_call, not_native
from . import kernel

__all__ = ["gather", "embedding"]


def _bind_gather(p: Any, ins: dict, outs: list, ctx: Any) -> Any:
    """Rows of a 2-D ``x`` by 1-D indices (a LastToken's gather) straight into the
    planned buffer; None (the generic call) for anything else."""
    out, x, idx = outs[0], ins["x"], ins["indices"]
    xs = x.desc.shape if type(x) is Slot else tuple(x.shape)
    ids = idx.desc.shape if type(idx) is Slot else tuple(idx.shape)
    if (type(out) is Slot or out.device.type != "cpu" or not out.is_contiguous()
            or len(xs) != 2 or len(ids) != 1 or p.axis % 2 != 0):
        return None
    get_x, get_i = getter(x), getter(idx)
    rows = _c_rows(out, x)

    def call(env: list) -> None:
        xv, iv = get_x(env), get_i(env)
        if rows is None or rows(xv, iv) != 0:  # not the C row gather's case
            not_native()
            torch.index_select(xv, 0, iv, out=out)
    return native_call(call)


def _c_rows(out: torch.Tensor, x: Any) -> Any:
    """The C row gather into ``out`` (:func:`gather_rows_into`), None where the C kernels
    are absent."""
    from ..cpu_kernels import available

    if not available():
        return None
    from ..cpu_kernels.torch_gather import gather_rows_into

    return gather_rows_into(out, x.desc.dtype.torch if type(x) is Slot else x.dtype)


@kernel("Gather", impl="torch.index_select; bound on the CPU for rows of a matrix: into "
        "the planned buffer", bind=_bind_gather)
def gather(p, ins):
    x, idx = ins["x"], ins["indices"]
    axis = p.axis % x.dim()
    # index_select takes 1-D indices; reshape restores idx's shape in place of axis.
    y = torch.index_select(x, axis, idx.reshape(-1).long())
    return [y.reshape(x.shape[:axis] + idx.shape + x.shape[axis + 1:])]


def _bind_embedding(p: Any, ins: dict, outs: list, ctx: Any) -> Any:
    out = outs[0]
    if type(out) is Slot or out.device.type != "cpu" or not out.is_contiguous():
        return None
    rows = out.view(-1, out.shape[-1])
    get_ids, get_w = getter(ins["ids"]), getter(ins["weight"])
    c_rows = _c_rows(out, ins["weight"])

    def call(env: list) -> None:
        ids, w = get_ids(env), get_w(env)
        if c_rows is not None:
            status = c_rows(w, ids.reshape(-1))
            if status == 0:
                return
            not_native()
            if status < 0:  # an id outside the table: nothing written
                n = int(w.shape[0])
                check_index_range("Embedding", "ids", ids, n, f"the table has {n} rows")
        try:
            torch.index_select(w, 0, ids.reshape(-1), out=rows)
        except (IndexError, RuntimeError):
            n = int(w.shape[0])
            check_index_range("Embedding", "ids", ids, n, f"the table has {n} rows")
            raise
    return native_call(call, c_rows is not None)


_bind_embedding.checks_values = True  # type: ignore[attr-defined]


@kernel("Embedding", impl="torch.nn.functional.embedding; bound on the CPU: index_select "
        "into the planned buffer", bind=_bind_embedding)
def embedding(p, ins):
    return [F.embedding(ins["ids"].long(), ins["weight"])]
