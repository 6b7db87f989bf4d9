"""CUDA-only runtime paths: independent branches on separate streams, and a plan
captured as a CUDA graph (one replay = one launch). Skipped where no GPU exists."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import atbcore as atb
from atbcore.backends.torch import TORCH_KERNELS
from atbcore.errors import CapabilityError
from atbcore.graph.ir import Graph, Node
from atbcore.ops.registry import get_op
from atbcore.runtime.cuda import CapturedPlan, cuda_graph_unavailable_reason
from atbcore.runtime.executor import build_plan
from atbcore.runtime.profiler import Profiler
from atbcore.tensor import TensorDesc
from oracle import rand

H = 64
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch.cuda.is_available() is False)")


def P(op, **kw):
    return get_op(op).make_params(kw)


def branches() -> Graph:
    """Two independent 3-node chains joined by AddRmsNorm (two streams' worth)."""
    nodes = []
    for br, src in (("p", "x"), ("q", "y")):
        nodes += [Node(f"{br}1", "LayerNorm", P("LayerNorm"), (src, "w", "b"), (f"{br}a",)),
                  Node(f"{br}2", "RmsNorm", P("RmsNorm"), (f"{br}a", "w"), (f"{br}b",)),
                  Node(f"{br}3", "LayerNorm", P("LayerNorm"), (f"{br}b", "w", "b"), (f"{br}c",))]
    nodes.append(Node("join", "AddRmsNorm", P("AddRmsNorm"), ("pc", "qc", "w"), ("z", "s")))
    return Graph("branches", ("x", "y"), ("z", "s"), tuple(nodes),
                 weights=(("w", rand([H], seed=1) + 1), ("b", rand([H], seed=2))))


def reference(g, feeds):
    descs = {k: TensorDesc(v.shape) for k, v in feeds.items()}
    return build_plan(g, descs, backend="numpy").run(feeds)


def feeds(seed, shape=(4, 128, H)):
    return {"x": rand(shape, seed=seed), "y": rand(shape, seed=seed + 100)}


def test_cpu_plans_refuse_cuda_graphs_with_the_reason():
    plan = build_plan(branches(), {k: TensorDesc(v.shape) for k, v in feeds(0).items()})
    why = cuda_graph_unavailable_reason(plan)
    assert why == "CUDA graphs need a CUDA device; this plan runs on cpu"
    with pytest.raises(CapabilityError, match="CUDA graphs need a CUDA device"):
        CapturedPlan(plan, {}, plan.descs)
    # streams are a CUDA feature: a cpu plan runs on one
    assert build_plan(branches(), {k: TensorDesc(v.shape) for k, v in feeds(0).items()},
                      num_streams=4).num_streams == 1


@needs_cuda
def test_branches_on_two_streams_match_the_reference():
    g = branches()
    f = feeds(1)
    dev = {k: torch.from_numpy(v).cuda() for k, v in f.items()}
    plan = build_plan(g, {k: TensorDesc(v.shape, device="cuda:0") for k, v in f.items()},
                      num_streams=2)
    streams = {c.node: c.stream for c in plan.calls}
    assert streams["p1"] == streams["p2"] == streams["p3"] != streams["q1"]
    ref = reference(g, f)
    for _ in range(3):  # repeated runs on the same streams stay ordered
        outs = plan.run(dev)
        for o, r in zip(outs, ref):
            atb.assert_close(o.cpu(), r, what="two-stream run")
    prof = Profiler()
    plan.run(dev, profiler=prof)
    assert {e["tid"] for e in prof.to_chrome_trace()["traceEvents"] if e["ph"] == "X"} == {0, 1}


@needs_cuda
def test_captured_plan_replays_as_one_launch_with_new_inputs():
    g = branches()
    f0, f1 = feeds(2), feeds(3)
    descs = {k: TensorDesc(v.shape, device="cuda:0") for k, v in f0.items()}
    plan = build_plan(g, descs)
    assert plan.launches == 3 * 2 + TORCH_KERNELS["AddRmsNorm"].launches and cuda_graph_unavailable_reason(plan) is None
    cap = CapturedPlan(plan, {k: torch.from_numpy(v).cuda() for k, v in f0.items()},
                       plan.descs)
    assert cap.launches == 1 and cap.staging == 4
    for f in (f1, f0, f1):
        outs = cap.replay({k: torch.from_numpy(v).cuda() for k, v in f.items()})
        for o, r in zip(outs, reference(g, f)):
            atb.assert_close(o.cpu(), r, what="CUDA graph replay")
    a = cap.replay({k: torch.from_numpy(v).cuda() for k, v in f1.items()})[0]
    b = cap.replay({k: torch.from_numpy(v).cuda() for k, v in f0.items()})[0]
    assert not torch.equal(a, b)  # outputs are fresh copies, not the static buffer


@needs_cuda
def test_weights_move_to_the_device_once():
    plan = build_plan(branches(), {k: TensorDesc(v.shape, device="cuda:0")
                                   for k, v in feeds(0).items()})
    assert {str(t.device) for t in plan.weights_env.values()} == {"cuda:0"}
    assert np.array_equal(plan.weights_env["w"].cpu().numpy(), branches().weight_map["w"])
