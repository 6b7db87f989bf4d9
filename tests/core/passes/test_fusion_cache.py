"""The ``rope_cache`` fusion: RoPE whose rotated k only a ReshapeAndCache writes ->
one RopeKVCache writing the paged rows of ``slot_mapping``; Before/Expected by hand,
the same numbers as the unfused graph (NumPy interpreter and the torch backend's
bound plan), and the cases it must leave alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import atbcore as atb
from graphs import G, N, assert_graph_eq, fuse
from interp import run_graph

T, HQ, HK, D, NB, BS = 5, 4, 2, 8, 3, 4
ROPE = dict(head_dim=D, num_heads=HQ, num_kv_heads=HK)
INPUTS = {"q": (1, T, HQ * D), "k": (1, T, HK * D), "v": (T, HK * D),
          "kc": (NB, BS, HK, D), "vc": (NB, BS, HK, D),
          "pos": atb.TensorDesc((T,), "int64"), "slots": atb.TensorDesc((T,), "int32")}


def cache_graph(k_read_elsewhere=False):
    nodes = [N("rope", "RoPE", ["q", "k", "pos"], ["q_rot", "k_rot"], **ROPE),
             N("k_heads", "Reshape", "k_rot", shape=(-1, HK, D)),
             N("v_heads", "Reshape", "v", shape=(-1, HK, D)),
             N("write", "ReshapeAndCache", ["k_heads", "v_heads", "kc", "vc", "slots"],
               ["kc_out", "vc_out"])]
    outs = ["q_rot", "kc_out", "vc_out"] + (["k_rot"] if k_read_elsewhere else [])
    return G(nodes, INPUTS, outs)


def feeds(seed=0):
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return [r(1, T, HQ * D), r(1, T, HK * D), r(T, HK * D), np.zeros((NB, BS, HK, D), np.float32),
            np.zeros((NB, BS, HK, D), np.float32), np.array([0, 1, 2, 9, 3]),
            np.array([0, 1, 2, 6, 11], np.int32)]


def test_rope_then_cache_write_becomes_one_node():
    before = cache_graph()
    got = fuse(fuse(before, "rope_cache"), "rope_cache")  # a second pass changes nothing
    # v back in k's shape (k is a graph input here, so its concrete shape; the
    # pipeline's cleanup folds the two reshapes into one)
    want = G([N("v_heads", "Reshape", "v", shape=(-1, HK, D)),
              N("rope.v", "Reshape", "v_heads", shape=(1, T, HK * D)),
              N("rope", "RopeKVCache", ["q", "k", "rope.v", "kc", "vc", "pos", "", "", "slots"],
                ["q_rot", "kc_out", "vc_out"], **ROPE)], INPUTS, ["q_rot", "kc_out", "vc_out"])
    assert_graph_eq(got, want)
    a, b = feeds(), feeds()
    for x, y in zip(run_graph(before, a), run_graph(got, b)):
        atb.assert_close(y, x, "fp32", "RopeKVCache vs RoPE + ReshapeAndCache")
    # the paged rows hold the rotated k: the unwritten slots stay zero
    kc = b[3].reshape(-1, HK, D)
    assert (np.abs(kc[[0, 1, 2, 6, 11]]).reshape(5, -1).max(axis=1) > 0).all()
    assert not kc[[3, 4, 5, 7, 8, 9, 10]].any()


def test_torch_bound_plan_matches_the_unfused_graph():
    """The GraphOp (fusion on, torch backend, bound once) against the interpreter on
    the unfused graph, twice (the second run reuses the packed call with new rows)."""
    before = cache_graph()
    op = atb.GraphOp(before, backend="torch")
    for seed in (0, 1):
        a = feeds(seed)
        ta = [torch.from_numpy(x.copy()) for x in a]
        got = op(*ta)
        want = run_graph(before, a)
        for g_, w_ in zip(got, want):
            atb.assert_close(g_, w_, "fp32", f"bound RopeKVCache (run {seed})")
        atb.assert_close(ta[3], a[3], "fp32", "the key cache written in place")
    assert [n.op for n in op.graph.nodes] == ["Reshape", "RopeKVCache"]


def test_rope_cache_needs_k_read_by_the_cache_write_alone():
    g = cache_graph(k_read_elsewhere=True)
    assert fuse(g, "rope_cache") == g


@pytest.mark.parametrize("bad_slot", [12, -1])
def test_a_slot_outside_the_cache_raises_and_writes_nothing(bad_slot):
    op = atb.GraphOp(cache_graph(), backend="torch")
    a = [torch.from_numpy(x) for x in feeds()]
    op(*a)
    kc = a[3].clone()
    a[6][3] = bad_slot
    with pytest.raises(atb.AtbError, match="slot"):
        op(*a)
    assert torch.equal(a[3], kc)
