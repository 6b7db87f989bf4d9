"""RmsNormLinear against its NumPy reference, torch.nn.functional, and the unfused
RmsNorm + Linear pair; the ``norm_linear`` fusion as a Before/Expected graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import atbcore as atb
from atbcore.graph.ir import Graph, Node
from atbcore.ops.linear import quantize_w8
from atbcore.ops.registry import get_op
from atbcore.passes.pipeline import FusionConfig, run_pipeline
from oracle import check_error, check_op, rand

K, N = 96, 80


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("rows", [1, 9, 70])
def test_matches_reference_and_the_unfused_pair(rows, dtype):
    x, nw = rand((rows, K), dtype, 1), rand((K,), dtype, 2, low=0.5, high=1.5)
    w, b = rand((N, K), dtype, 3, scale=K ** -0.5), rand((N,), dtype, 4)
    check_op("RmsNormLinear", {"eps": 1e-5}, [x, nw, w, b])
    t = [torch.from_numpy(np.asarray(a, np.float32)).to(getattr(torch, {
        "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype])) for a in (x, nw, w, b)]
    fused, = atb.Builder().build_operation("RmsNormLinear", {"eps": 1e-5}).execute(t)
    n, = atb.Builder().build_operation("RmsNorm", {"eps": 1e-5}).execute(t[:2])
    y, = atb.Builder().build_operation("Linear", {}).execute([n, t[2], t[3]])
    assert torch.equal(fused, y)  # the norm rounds to x's dtype as RmsNorm stores it
    gold = F.linear(F.rms_norm(t[0].float(), (K,), t[1].float(), 1e-5).to(t[0].dtype).float(),
                    t[2].float(), t[3].float())
    atb.assert_close(fused.float(), gold, dtype, "RmsNormLinear vs torch.nn.functional")


def test_w8_and_transposed_weights():
    x, nw = rand((5, K), "fp32", 1), rand((K,), "fp32", 2, low=0.5, high=1.5)
    q, s = quantize_w8(rand((N, K), "fp32", 3))
    check_op("RmsNormLinear", {"eps": 1e-6, "quant": "w8"}, [x, nw, q, None, s])
    wt = rand((K, N), "fp32", 5)
    check_op("RmsNormLinear", {"eps": 1e-6, "transpose_weight": False}, [x, nw, wt])


def test_bad_inputs_name_the_op():
    x, w = rand((2, K)), rand((N, K))
    check_error("RmsNormLinear", {}, [x, rand((K + 1,)), w], atb.ShapeError, "RmsNormLinear",
                "norm_weight")
    check_error("RmsNormLinear", {"eps": -1.0}, [], atb.ParamsError, "eps", build_error=True)


def _p(op, **kw):
    return get_op(op).make_params(kw)


def test_fusion_rule_before_and_expected():
    nw, w, b = rand((K,), seed=1), rand((N, K), seed=2), rand((N,), seed=3)
    before = Graph("g", ("x",), ("y",), (
        Node("norm", "RmsNorm", _p("RmsNorm", eps=1e-5), ("x", "nw"), ("h",)),
        Node("proj", "Linear", _p("Linear", bias=True), ("h", "w", "b"), ("y",)),
    ), weights=(("nw", nw), ("w", w), ("b", b))).with_descs({"x": atb.TensorDesc((3, K))})
    after, _ = run_pipeline(before, FusionConfig())
    expected = Graph("g", ("x",), ("y",), (
        Node("proj", "RmsNormLinear", _p("RmsNormLinear", eps=1e-5, bias=True),
             ("x", "nw", "w", "b"), ("y",)),), weights=(("nw", nw), ("w", w), ("b", b)))
    assert after == expected
    # a norm with another reader, or an offset weight, stays
    shared = before.replace(outputs=("y", "h"))
    assert [n.op for n in run_pipeline(shared, FusionConfig())[0].nodes] == ["RmsNorm", "Linear"]
    gemma = before.replace(nodes=(before.nodes[0].replace(
        params=_p("RmsNorm", eps=1e-5, weight_offset=1.0)), before.nodes[1]))
    assert [n.op for n in run_pipeline(gemma, FusionConfig())[0].nodes] == ["RmsNorm", "Linear"]
    off = FusionConfig(disable=("norm_linear",))
    assert [n.op for n in run_pipeline(before, off)[0].nodes] == ["RmsNorm", "Linear"]
