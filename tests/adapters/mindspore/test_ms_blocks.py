"""Acceptance: a LLaMA decoder layer and a BERT encoder layer, each built once as a
core graph, give the same outputs (DESIGN.md §5, fp32) as GraphOps in atb_torch, in
atb_mindspore under PyNative, GRAPH_MODE and ``mindspore.jit``, and in a plain
MindSpore implementation (``nn.Dense``, ``nn.LayerNorm``, attention by hand) with
the same weights. In PyNative every fused node runs on MindSpore kernels."""

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="mindspore is not installed")

import atb_mindspore as atb  # noqa: E402
from atbcore.numerics import assert_close  # noqa: E402
from ms_blocks import (BERT, LLAMA, PlainBert, PlainLlama, bert_mask, bert_weights,  # noqa: E402
                       build_bert, build_llama, llama_weights)


def _torch_out(graph, inputs):
    torch = pytest.importorskip("torch", reason="torch is not installed (atb_torch leg)")
    import atb_torch

    with torch.no_grad():
        out = atb_torch.GraphOp(graph)(*[torch.from_numpy(x.copy()) for x in inputs])
    return out.numpy()


def _ms_modes(graph, inputs):
    """(PyNative, GRAPH_MODE, jit) outputs of one atb_mindspore GraphOp Cell."""
    cell = atb.GraphOp(graph)
    ts = [ms.Tensor(x) for x in inputs]
    eager = cell(*ts).asnumpy()
    assert {c.backend for c in cell.core.last_plan.calls} == {"mindspore"}
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        graph_out = cell(*ts).asnumpy()
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    if len(ts) == 1:
        def run(x):
            return cell(x) * 1.0
    else:
        def run(x, mask):
            return cell(x, mask) * 1.0
    return eager, graph_out, ms.jit(run)(*ts).asnumpy()


def _check_all(name, graph, inputs, plain):
    want = plain(*[ms.Tensor(x) for x in inputs]).asnumpy()
    got = dict(zip(("pynative", "graph_mode", "jit"), _ms_modes(graph, inputs)))
    got["atb_torch"] = _torch_out(graph, inputs)
    for k, v in got.items():
        assert_close(v, want, "fp32", what=f"{name}: atb {k} vs plain MindSpore")
    assert_close(got["pynative"], got["atb_torch"], "fp32", what=f"{name}: mindspore vs torch")


def test_llama_decoder_layer():
    w = llama_weights()
    graph = build_llama(w)
    x = np.random.default_rng(3).standard_normal((LLAMA["batch"], LLAMA["seq"], LLAMA["hidden"]))
    _check_all("llama", graph, [x.astype(np.float32)], PlainLlama(w))
    fused = [n.op for n in atb.GraphOp(graph).build(ms.Tensor(x.astype(np.float32))).core.graph.nodes]
    assert "RopeFlashAttention" in fused and "FusedFeedForward" in fused, fused


def test_bert_encoder_layer():
    w = bert_weights()
    graph = build_bert(w)
    x = np.random.default_rng(4).standard_normal((BERT["batch"], BERT["seq"], BERT["hidden"]))
    _check_all("bert", graph, [x.astype(np.float32), bert_mask()], PlainBert(w))


def test_graph_op_vs_numpy_reference():
    """The same LLaMA graph on the NumPy reference backend: the MindSpore kernels'
    result is within §5 of the oracle, not only of other implementations."""
    w = llama_weights(seed=5)
    graph = build_llama(w)
    x = np.random.default_rng(6).standard_normal((2, 7, 32)).astype(np.float32)
    ref = atb.GraphOp(graph, backend="numpy")(ms.Tensor(x)).asnumpy()
    got = atb.GraphOp(graph)(ms.Tensor(x)).asnumpy()
    assert_close(got, ref, "fp32", what="llama: mindspore kernels vs numpy reference")
