"""GraphOp save/load (bit-exact weights, same fusion, same results) and drawing the
graph before and after fusion."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import atbcore as atb
from atbcore.graph import layers as L
from atbcore.graph.graph_op import GraphOp
from oracle import rand

H = 32


def mlp() -> GraphOp:
    return GraphOp([L.LayerNorm(eps=1e-5), L.Linear(out_features=2 * H), L.SiLU(),
                    L.Linear(out_features=H), L.ResidualAdd()], name="mlp",
                   fusion_config={"fusion_level": "standard", "enable_qkv_fusion": False},
                   dynamic_shape={"seq_len": (1, 64)})


def test_save_load_round_trip_is_bit_exact_and_keeps_settings(tmp_path):
    op = mlp()
    x = rand([2, 5, H], seed=1)
    y = op(x)
    with pytest.raises(atb.GraphError, match="not built yet"):
        mlp().save(tmp_path / "early")  # layers are lowered at the first call
    path = op.save(tmp_path / "mlp")
    assert sorted(os.listdir(path)) == ["graph.json", "graph_op.json", "weights.safetensors"]
    meta = json.load(open(os.path.join(path, "graph_op.json")))
    assert meta["fusion_config"]["enable_qkv_fusion"] is False
    back = GraphOp.load(path)
    assert back.name == "mlp" and back.fusion_config == op.fusion_config
    y2 = back(x)
    assert back.graph_unfused == op.graph_unfused  # structure and weight bytes
    assert back.graph == op.graph
    np.testing.assert_array_equal(y2, y)  # same kernels, same weights: identical bits
    with pytest.raises(atb.ShapeError, match="seq_len"):  # the dynamic range came back too
        back(rand([1, 65, H]))
    other = GraphOp.load(path, fusion_config={"fusion_level": "conservative"})
    other(x)
    assert len(other.graph.nodes) == len(op.graph_unfused.nodes) > len(op.graph.nodes)


def test_draw_before_and_after_fusion():
    op = mlp()
    with pytest.raises(atb.GraphError, match="not built yet"):
        op.to_dot()
    op(rand([1, 3, H]))
    before, after = op.to_dot("before"), op.to_dot()
    assert before.startswith("digraph") and "SiLU" in before and "SiLU" not in after
    assert "FusedFeedForward" in after
    m = op.to_mermaid("after")
    assert m.startswith("flowchart") and "FusedFeedForward" in m
    assert "SiLU" in op.to_mermaid("before")
    with pytest.raises(atb.ParamsError, match="before/after"):
        op.to_dot("sideways")
