"""Every collective and every LinearParallel variant on 2 real gloo processes,
against the NumPy reference given both ranks' inputs (``reference_ranks``).
One spawn runs all cases; each test checks one of them."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from atbcore.numerics import assert_close
from atbcore.ops.registry import get_op
from oracle import rand

sys.path.insert(0, os.path.dirname(__file__))
from collective_workers import fail_on_rank_1, run_cases, run_graph, torch_tensors  # noqa: E402
from dist_ranks import run_ranks  # noqa: E402

WORLD = 2


def _inputs(shapes, dtype, seed):
    """Per rank: a list of inputs (rank r's seeds differ)."""
    out = []
    for r in range(WORLD):
        row = []
        for i, shape in enumerate(shapes):
            if dtype == "int32":
                row.append(np.random.default_rng(seed + 10 * r + i).integers(-5, 6, shape
                                                                             ).astype(np.int32))
            else:
                row.append(rand(shape, dtype, seed + 10 * r + i))
        out.append(row)
    return out


def _linear_parallel(kind, dtype, transpose=True, group="default"):
    x = (4, 6) if kind != "all_gather_linear" else (3, 2, 12)
    w_shape = (5, 6) if kind != "all_gather_linear" else (4, 12)
    per_rank = _inputs([x, w_shape if transpose else w_shape[::-1], (w_shape[0],)], dtype, 40)
    for r in range(1, WORLD):  # the bias is replicated
        per_rank[r][2] = per_rank[0][2]
    return ("LinearParallel", {"type": kind, "transpose_weight": transpose}, per_rank, group)


def _embedding_shards():
    """Rows [0, 3) on rank 0 and [3, 6) on rank 1; the same ids on both ranks."""
    table = rand((6, 4), "fp32", 12)
    ids = np.array([[5, 0, 3], [2, 4, 1]], np.int64)
    return [[table[:3].copy(), ids], [table[3:].copy(), ids.copy()]]


CASES = {
    **{f"AllReduce-{op}-{dt}": ("AllReduce", {"op": op}, _inputs([(3, 5)], dt, 1), "default")
       for op in ("sum", "max", "min", "prod") for dt in ("fp32", "int32")},
    "AllReduce-sum-fp16": ("AllReduce", {"op": "sum"}, _inputs([(2, 7)], "fp16", 2), "name"),
    "AllReduce-sum-bf16": ("AllReduce", {"all_reduce_type": "sum", "rank_size": 2},
                           _inputs([(9,)], "bf16", 3), "object"),
    "AllGather-stack": ("AllGather", {}, _inputs([(2, 3)], "fp32", 4), "default"),
    "AllGather-last": ("AllGather", {"axis": -1}, _inputs([(2, 3, 4)], "fp16", 5), "name"),
    "ReduceScatter-sum-0": ("ReduceScatter", {}, _inputs([(4, 3)], "fp32", 6), "default"),
    "ReduceScatter-max-1": ("ReduceScatter", {"op": "max", "axis": 1},
                            _inputs([(3, 6, 2)], "bf16", 7), "object"),
    "Broadcast-root1": ("Broadcast", {"root": 1}, _inputs([(3, 4)], "fp32", 8), "name"),
    "Broadcast-root0-int": ("Broadcast", {"rank_root": 0}, _inputs([(5,)], "int32", 9),
                            "default"),
    "AllToAll-0": ("AllToAll", {}, _inputs([(4, 3)], "fp32", 10), "default"),
    "AllToAll-1": ("AllToAll", {"axis": 1}, _inputs([(2, 6, 3)], "fp16", 11), "object"),
    "VocabParallelEmbedding": ("VocabParallelEmbedding", {}, _embedding_shards(), "name"),
    "LinearParallel-all_reduce": _linear_parallel("linear_all_reduce", "fp32"),
    "LinearParallel-all_reduce-fp16": _linear_parallel("linear_all_reduce", "fp16", group="name"),
    "LinearParallel-reduce_scatter": _linear_parallel("linear_reduce_scatter", "fp32"),
    "LinearParallel-reduce_scatter-in_out": _linear_parallel("linear_reduce_scatter", "bf16",
                                                             transpose=False, group="object"),
    "LinearParallel-all_gather": _linear_parallel("all_gather_linear", "fp32"),
    "LinearParallel-all_gather-fp16": _linear_parallel("all_gather_linear", "fp16",
                                                       group="name"),
}


@pytest.fixture(scope="module")
def results():
    """Every case's outputs per rank, from one pair of processes."""
    got = run_ranks(run_cases, (list(CASES.values()),), world=WORLD)
    return {name: [got[r][i] for r in range(WORLD)] for i, name in enumerate(CASES)}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_rank_gets_its_share_of_the_reference(results, name):
    op, params, per_rank, _ = CASES[name]
    opdef = get_op(op)
    p = opdef.make_params(params)
    names = opdef.input_names
    want = opdef.reference_ranks(p, [dict(zip(names, ins)) for ins in per_rank])
    for r in range(WORLD):
        (got,), (ref,) = results[name][r], want[r]
        assert got.shape == ref.shape and got.dtype == ref.dtype, (name, r, got.shape, ref.shape)
        if ref.dtype.kind in "iu":
            np.testing.assert_array_equal(got, ref, err_msg=f"{name} rank {r}")
        else:
            assert_close(got, ref, what=f"{name} rank {r}")
    if op in ("AllReduce", "AllGather", "Broadcast", "VocabParallelEmbedding") or params.get("type") == "linear_all_reduce":
        # every rank holds the same result (bit-exact: one reduction, shared)
        np.testing.assert_array_equal(results[name][0][0], results[name][1][0])


def test_reference_is_not_the_identity():
    """The oracle really combines ranks: rank 0's reduce-scatter share differs from
    its own input chunk and all-to-all swaps chunks."""
    _, params, per_rank, _ = CASES["AllToAll-0"]
    p = get_op("AllToAll").make_params(params)
    out = get_op("AllToAll").reference_ranks(p, [{"x": ins[0]} for ins in per_rank])
    np.testing.assert_array_equal(out[0][0][2:], per_rank[1][0][:2])
    np.testing.assert_array_equal(out[1][0][:2], per_rank[0][0][2:])


def test_vocab_parallel_reference_is_the_whole_table_lookup():
    per_rank = CASES["VocabParallelEmbedding"][2]
    p = get_op("VocabParallelEmbedding").make_params({})
    out = get_op("VocabParallelEmbedding").reference_ranks(
        p, [{"weight": w, "ids": i} for w, i in per_rank])
    table = np.concatenate([per_rank[0][0], per_rank[1][0]])
    np.testing.assert_array_equal(out[0][0], table[per_rank[0][1]])


def test_graph_op_with_parallel_nodes():
    """LinearParallel and AllGather as GraphOp nodes (through the pass pipeline and
    the plan): a row-parallel projection + all-reduce, a column-parallel Linear, the
    columns gathered -- equal on both ranks to the unsharded two-layer NumPy math."""
    rng = np.random.default_rng(0)
    x_full = rng.standard_normal((2, 3, 8)).astype(np.float32)
    w_row_full = rng.standard_normal((6, 8)).astype(np.float32)
    w_col_full = rng.standard_normal((4, 6)).astype(np.float32)
    bias = rng.standard_normal(6).astype(np.float32)
    xs = np.split(x_full, WORLD, axis=-1)
    w_row = [np.ascontiguousarray(w) for w in np.split(w_row_full, WORLD, axis=1)]
    w_col = [np.ascontiguousarray(w) for w in np.split(w_col_full, WORLD, axis=0)]
    want = (x_full.astype(np.float64) @ w_row_full.T + bias) @ w_col_full.T
    got = run_ranks(run_graph, ([np.ascontiguousarray(x) for x in xs], w_row, w_col, bias))
    for r in range(WORLD):
        for y in got[r]:
            assert_close(y, want, "fp32", what=f"rank {r}")


def test_a_failing_rank_is_reported_and_nothing_hangs():
    import time

    import atbcore as atb

    t0 = time.perf_counter()
    with pytest.raises(atb.AtbError, match="rank 1 failed(.|\n)*broke on purpose"):
        run_ranks(fail_on_rank_1, (), timeout=60)
    assert time.perf_counter() - t0 < 50  # rank 0, stuck in its barrier, was killed


def test_ranks_return_torch_tensors_by_value():
    # the queue's torch pickler passed tensors as shared-memory fds, gone when the rank
    # exited first (FileNotFoundError in the parent, 2 runs of 4 here): now bytes
    import torch

    for _ in range(3):
        got = run_ranks(torch_tensors, ())
        for r, (a, b) in enumerate(got):
            assert torch.equal(a, torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r)
            assert torch.equal(b, torch.full((4,), r, dtype=torch.int64))
