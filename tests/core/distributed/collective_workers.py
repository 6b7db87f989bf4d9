"""What each rank runs in test_collectives_2proc (importable by the spawned ranks)."""

from __future__ import annotations

import numpy as np


def run_cases(rank: int, world: int, cases: list) -> list:
    """Each case ``(op, params, per_rank_inputs, group_kind)`` run on this rank's
    inputs with the torch kernels; returns the outputs as NumPy arrays."""
    import torch.distributed as dist

    import atbcore as atb
    from atbcore.distributed import register_group
    from atbcore.tensor import to_numpy, to_torch

    pg = dist.new_group(list(range(world)))  # every rank creates it, in the same order
    register_group("tp", pg)
    out = []
    for op, params, per_rank, group_kind in cases:
        params = dict(params)
        if group_kind == "name":
            params["group"] = "tp"
        elif group_kind == "object":
            params["group"] = pg
        ins = [to_torch(np.array(x, copy=True)) for x in per_rank[rank]]
        before = [t.clone() for t in ins]
        ys = atb.Builder(backend="torch").build_operation(op, params).execute(ins)
        assert all(b.equal(t) for b, t in zip(before, ins)), f"{op} changed its input"
        out.append([to_numpy(y) for y in ys])
    return out


def run_graph(rank: int, world: int, xs: list, w_row: list, w_col: list, bias) -> list:
    """A GraphOp built from LinearParallel and AllGather nodes: row-parallel
    projection with all-reduce, then column-parallel with the result gathered."""
    from atbcore.graph.builder import GraphBuilder
    from atbcore.graph.graph_op import GraphOp
    from atbcore.tensor import TensorDesc, to_numpy, to_torch

    b = GraphBuilder("tp_block")
    x = b.add_input("x", TensorDesc(xs[rank].shape, "fp32"))
    w1 = b.add_weight("w_row", w_row[rank])
    bb = b.add_weight("bias", bias)
    w2 = b.add_weight("w_col", w_col[rank])
    h, = b.add_node("LinearParallel", [x, w1, bb], {"type": "linear_all_reduce"}, name="row")
    c, = b.add_node("Linear", [h, w2], name="col")
    y, = b.add_node("AllGather", [c], {"axis": -1}, name="gather")
    b.mark_output(y)
    op = GraphOp(b.build())
    first = to_numpy(op.execute([to_torch(xs[rank].copy())])[0])
    again = to_numpy(op.execute([to_torch(xs[rank].copy())])[0])  # the cached plan
    return [first, again]


def fail_on_rank_1(rank: int, world: int) -> None:
    """Rank 1 raises; rank 0 waits for it in a barrier that never completes."""
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank 1 broke on purpose")
    dist.barrier()


def torch_tensors(rank: int, world: int) -> list:
    """Rank-dependent torch tensors, returned the moment the rank is done (it exits
    before the parent reads them: the case the README's tensor-parallel block hits)."""
    import torch

    return [torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank,
            torch.full((4,), rank, dtype=torch.int64)]
