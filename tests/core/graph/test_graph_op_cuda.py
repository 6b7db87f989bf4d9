"""GraphOp on CUDA inputs: a captured CUDA graph replays as one launch and matches
the eager plan and the NumPy reference. Skipped where no GPU exists."""

from __future__ import annotations

import pytest
import torch

import atbcore as atb
from atbcore.graph.graph_op import GraphOp
from oracle import rand
from test_graph_op import B, H, S, attention_block, reference

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch.cuda.is_available() is False)")


@needs_cuda
def test_cuda_graph_replay_is_one_launch_and_matches():
    g = attention_block()
    eager = GraphOp(g)
    captured = GraphOp(g, cuda_graph=True)
    for seed in (1, 2, 3):
        x = rand([B, S, H], seed=seed)
        xd = torch.from_numpy(x).cuda()
        y, s = captured(xd)
        ye, _ = eager(xd)
        assert captured.last_launches == 1 and eager.last_launches == eager.last_plan.launches > 1
        assert y.device.type == "cuda"
        atb.assert_close(y.cpu(), reference(captured.graph, x)[0], what="captured y")
        atb.assert_close(y.cpu(), ye.cpu(), what="captured vs eager")
    assert len(captured._captured) == 1  # one capture per exact signature
    captured.destroy()
    eager.destroy()


@needs_cuda
def test_plugins_turn_capture_off_and_still_run():
    op = GraphOp(attention_block(), cuda_graph=True)
    x = torch.from_numpy(rand([B, S, H], seed=4)).cuda()
    op(x)
    op.register_plugin("pre_block", lambda ts: [t * 1 for t in ts])
    op(x)
    assert op.last_launches == op.last_plan.launches > 1


@needs_cuda
def test_llama_layer_on_cuda_graph_is_one_launch_per_forward():
    from interp import run_graph
    from llama_graphs import build_llama_layer_primitive

    g = build_llama_layer_primitive()
    fused = GraphOp(g, cuda_graph=True)
    unfused = GraphOp(g, fusion_config={"fusion_level": "conservative"})
    x = rand([2, 8, 64], seed=5)
    y = fused(torch.from_numpy(x).cuda())
    yu = unfused(torch.from_numpy(x).cuda())
    assert fused.last_launches == 1 and unfused.last_launches >= 30
    assert fused.last_launches <= 0.3 * unfused.last_launches
    atb.assert_close(y.cpu(), yu.cpu(), what="fused CUDA graph vs unfused")
    atb.assert_close(y.cpu(), run_graph(g, [x])[0], what="fused CUDA graph vs numpy")


@needs_cuda
def test_kv_cache_decoding_on_cuda():
    from test_graph_op_seed import _decode_steps, attention_block

    op = attention_block()
    x = torch.from_numpy(rand([2, 8, 64], seed=6)).cuda()
    full = op(x)
    got, state = _decode_steps(op, x, None)
    assert full.device.type == "cuda"
    atb.assert_close(got, full.cpu().numpy(), what="CUDA dict-cache decode")
