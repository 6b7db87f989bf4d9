"""Drawing (DOT, Mermaid, PNG where Graphviz is installed) and saving/loading
(JSON + safetensors, bit-exact)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import atbcore as atb
from atbcore.errors import CapabilityError, GraphError
from atbcore.graph import draw
from atbcore.graph.draw import png_available, render_png, to_dot, to_mermaid
from atbcore.graph.serialize import load_graph, read_safetensors, save_graph
from atbcore.passes.pipeline import run_pipeline
from graphs import G, N, w
from interp import run_graph
from llama_graphs import build_llama_layer_primitive


def small():
    return G([N("fc", "Linear", ["x", "w"]), N("act", "SiLU", "fc"),
              N("out", "ResidualAdd", ["act", "x"])], {"x": (2, 4)}, "out",
             {"w": w(4, 4)}).with_descs({"x": atb.TensorDesc((2, 4)), "fc": atb.TensorDesc((2, 4)),
                                         "act": atb.TensorDesc((2, 4))})


def test_dot_lists_every_node_edge_input_and_output():
    text = to_dot(small())
    assert text.startswith('digraph "g" {')
    assert 'n0 [label="fc\\nLinear\\n+1 weight", shape=box' in text
    assert 'i0 [label="x", shape=ellipse' in text and 'o0 [label="out", shape=doublecircle' in text
    edges = re.findall(r"^  (\w+) -> (\w+)", text, re.M)
    assert edges == [("i0", "n0"), ("n0", "n1"), ("n1", "n2"), ("i0", "n2"), ("n2", "o0")]
    assert 'label="fc\\n[2, 4] FP32"' in text
    with_w = to_dot(small(), weights=True)
    assert 'w0 [label="w", shape=note' in with_w and ("w0", "n0") in re.findall(
        r"^  (\w+) -> (\w+)", with_w, re.M)


def test_mermaid_draws_the_same_graph():
    text = to_mermaid(small())
    lines = text.splitlines()
    assert lines[0] == "flowchart TD"
    assert '  n0["fc<br/>Linear<br/>+1 weight"]' in lines
    assert '  i0 -->|"x [2, 4] FP32"| n0' in lines and "  n2 --> o0" in lines
    assert len([l for l in lines if "-->" in l]) == 5
    fused, _ = run_pipeline(build_llama_layer_primitive())
    assert to_mermaid(fused).count("-->") < to_mermaid(build_llama_layer_primitive()).count("-->")


def test_png_where_graphviz_is_installed(tmp_path):
    why = png_available()
    if why is not None:
        pytest.skip(f"Graphviz not usable here: {why}")
    path = render_png(small(), tmp_path / "g.png")
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_png_without_graphviz_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(draw.shutil, "which", lambda name: None)
    with pytest.raises(CapabilityError, match="'dot' binary is not installed"):
        render_png(small(), tmp_path / "h.png")


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    g = build_llama_layer_primitive(dtype=dtype)
    fused, _ = run_pipeline(g)
    for i, graph in enumerate((g, fused)):
        d = save_graph(graph, tmp_path / str(i))
        back = load_graph(d)
        assert back == graph and back.descs == graph.descs
        for (k1, a), (k2, b) in zip(graph.weights, back.weights):
            assert k1 == k2 and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    x = np.random.default_rng(0).standard_normal((2, 8, 64)).astype(atb.Dtype.of(dtype).numpy)
    np.testing.assert_array_equal(run_graph(load_graph(tmp_path / "1"), [x])[0],
                                  run_graph(fused, [x])[0])


def test_file_formats_are_standard(tmp_path):
    from safetensors.torch import load_file

    tw = torch.randn(4, 4, dtype=torch.bfloat16)
    g = G([N("c", "Elewise", "x", elewise_type="cast", out_dtype="fp16"),
           N("y", "Linear", ["x", "tw"]),
           N("s", "Elewise", "y", elewise_type="muls", var_attr=float("inf"))],
          {"x": atb.TensorDesc((2, 4), "bf16")}, ["c", "s"], {"tw": tw})
    save_graph(g, tmp_path)
    doc = json.load(open(tmp_path / "graph.json"))
    node = doc["nodes"][0]
    assert node["params"]["fields"]["out_dtype"] == {"dtype": "FP16"}
    assert doc["nodes"][2]["params"]["fields"]["scalar"] == {"float": "inf"}
    st = load_file(str(tmp_path / "weights.safetensors"))
    assert torch.equal(st["tw"], tw)
    assert read_safetensors(tmp_path / "weights.safetensors")["tw"].dtype == atb.Dtype.BF16.numpy
    back = load_graph(tmp_path)
    assert back == g and back.nodes[0].params.out_dtype == atb.Dtype.FP16


def test_hints_survive_and_damage_is_reported(tmp_path):
    p = atb.get_op("FlashAttention").make_params({"num_heads": 2, "support_flash": True})
    g = G([N("a", "Elewise", "x", elewise_type="neg")], {"x": (2,)}, "a")
    g = g.replace(nodes=(g.nodes[0].replace(op="FlashAttention", params=p),))
    save_graph(g, tmp_path)
    assert load_graph(tmp_path).nodes[0].params.hints == {"support_flash": True}
    with pytest.raises(GraphError, match="cannot read graph.json"):
        load_graph(tmp_path / "nowhere")
    doc = json.load(open(tmp_path / "graph.json"))
    doc["version"] = 99
    json.dump(doc, open(tmp_path / "graph.json", "w"))
    with pytest.raises(GraphError, match="graph file format"):
        load_graph(tmp_path)
