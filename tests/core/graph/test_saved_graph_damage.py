"""Every damaged save directory raises an AtbError (GraphError naming the directory),
never a ValueError, KeyError, RecursionError or a graph built from garbage: the
weights file is damaged (truncation, offsets out of the file, negative or
overlapping, wrong dtypes and sizes, a bad header), ``graph.json`` is damaged
(truncation, non-UTF-8, deep nesting, unknown ops or params, values of the wrong
kind) and ``graph_op.json`` is damaged. The pristine directory loads and computes
what the saved GraphOp computed."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from atbcore.errors import AtbError, GraphError
from atbcore.graph import layers as L
from atbcore.graph import saved_doc
from atbcore.graph.graph_op import GraphOp
from atbcore.graph.serialize import load_graph
from oracle import rand

H = 16


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, np.ndarray, np.ndarray]:
    op = GraphOp([L.LayerNorm(eps=1e-5), L.Linear(out_features=2 * H), L.SiLU(),
                  L.Linear(out_features=H), L.ResidualAdd()], name="mlp",
                 dynamic_shape={"seq_len": (1, 64)})
    x = rand([2, 3, H], seed=3)
    y = op(x)
    path = Path(op.save(tmp_path_factory.mktemp("saved") / "mlp"))
    return path, x, y


# ------------------------------------------------------------------ damage helpers
def _st_split(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _st_join(path: Path, header: dict, body: bytes) -> None:
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + body)


def _weights(d: Path) -> Path:
    return d / "weights.safetensors"


def _tensors(header: dict) -> list[str]:
    return [k for k in header if k != "__metadata__"]


def _edit_header(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        header, body = _st_split(_weights(d))
        fn(header)
        _st_join(_weights(d), header, body)
    return damage


def _first(h: dict) -> dict:
    return h[_tensors(h)[0]]


def _set_offsets(i: int, offs: list[int]) -> Callable[[dict], None]:
    def fn(h: dict) -> None:
        h[_tensors(h)[i]]["data_offsets"] = offs
    return fn


def _overlap(h: dict) -> None:
    a, b = _tensors(h)[:2]
    h[b]["data_offsets"] = list(h[a]["data_offsets"])
    h[b]["shape"], h[b]["dtype"] = list(h[a]["shape"]), h[a]["dtype"]


def _edit_graph(fn: Callable[[dict], object]) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        doc = json.loads((d / "graph.json").read_text())
        res = fn(doc)
        (d / "graph.json").write_text(json.dumps(doc if res is None else res))
    return damage


def _edit_meta(fn: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        meta = json.loads((d / "graph_op.json").read_text())
        fn(meta)
        (d / "graph_op.json").write_text(json.dumps(meta))
    return damage


def _node(i: int, **kw) -> Callable[[dict], None]:
    def fn(doc: dict) -> None:
        doc["nodes"][i].update(kw)
    return fn


def _param(i: int, name: str, value) -> Callable[[dict], None]:
    def fn(doc: dict) -> None:
        doc["nodes"][i]["params"]["fields"][name] = value
    return fn


def _deep(depth: int) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        text = (d / "graph.json").read_text()
        doc = json.loads(text)
        field = next(iter(doc["nodes"][0]["params"]["fields"]))
        doc["nodes"][0]["params"]["fields"][field] = "@@DEEP@@"
        (d / "graph.json").write_text(json.dumps(doc).replace(
            '"@@DEEP@@"', "[" * depth + "]" * depth))
    return damage


def _truncate(name: str, keep: float | int) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        data = (d / name).read_bytes()
        n = keep if isinstance(keep, int) else int(len(data) * keep)
        (d / name).write_bytes(data[:n])
    return damage


def _replace(name: str, content: bytes) -> Callable[[Path], None]:
    return lambda d: (d / name).write_bytes(content)


def _remove(name: str) -> Callable[[Path], None]:
    return lambda d: os.remove(d / name)


def _into_dir(name: str) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        os.remove(d / name)
        (d / name).mkdir()
    return damage


def _header_len(n: int) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        data = _weights(d).read_bytes()
        _weights(d).write_bytes(struct.pack("<Q", n) + data[8:])
    return damage


def _raw_header(raw: bytes) -> Callable[[Path], None]:
    def damage(d: Path) -> None:
        _, body = _st_split(_weights(d))
        raw8 = raw + b" " * (-len(raw) % 8)
        _weights(d).write_bytes(struct.pack("<Q", len(raw8)) + raw8 + body)
    return damage


DAMAGE: dict[str, Callable[[Path], None]] = {
    # the weights file
    "weights truncated to half": _truncate("weights.safetensors", 0.5),
    "weights truncated to 4 bytes": _truncate("weights.safetensors", 4),
    "weights empty": _replace("weights.safetensors", b""),
    "weights missing": _remove("weights.safetensors"),
    "weights a directory": _into_dir("weights.safetensors"),
    "header length 2**60": _header_len(1 << 60),
    "header length past the file": _header_len(1 << 20),
    "header length 0": _header_len(0),
    "header not JSON": _raw_header(b"{not json"),
    "header not UTF-8": _raw_header(b'{"\xff\xfe": 1}'),
    "header a list": _raw_header(b"[1, 2]"),
    "negative offsets (header bytes as weights)": _edit_header(_set_offsets(0, [-64, 0])),
    "offsets past the end": _edit_header(_set_offsets(0, [0, 1 << 30])),
    "offsets reversed": _edit_header(_set_offsets(0, [64, 0])),
    "offsets overlapping": _edit_header(_overlap),
    "offsets leaving a gap": _edit_header(_set_offsets(-1, [4, 4 + 4 * H])),
    "offsets not ints": _edit_header(_set_offsets(0, ["0", "64"])),
    "dtype unknown": _edit_header(lambda h: _first(h).update(dtype="F99")),
    "dtype smaller than the data": _edit_header(lambda h: _first(h).update(dtype="F16")),
    "dtype not a string": _edit_header(lambda h: _first(h).update(dtype=7)),
    "shape larger than the data": _edit_header(lambda h: _first(h).update(shape=[H, H, H])),
    "shape negative": _edit_header(lambda h: _first(h).update(shape=[-1, H])),
    "shape missing": _edit_header(lambda h: _first(h).pop("shape")),
    "weight renamed": _edit_header(lambda h: h.update(renamed=h.pop(_tensors(h)[0]))),
    # graph.json
    "graph.json missing": _remove("graph.json"),
    "graph.json truncated": _truncate("graph.json", 0.5),
    "graph.json empty": _replace("graph.json", b""),
    "graph.json not UTF-8": _replace("graph.json", b'{"format": "atb-graph\xff\xfe"}'),
    "graph.json a directory": _into_dir("graph.json"),
    "graph.json a list": _edit_graph(lambda doc: [doc]),
    "graph.json nested 100000 deep": _deep(100_000),
    "graph.json nested 40 deep": _deep(40),
    "format version 99": _edit_graph(lambda doc: doc.update(version=99)),
    "name not a string": _edit_graph(lambda doc: doc.update(name=["x"])),
    "nodes missing": _edit_graph(lambda doc: doc.pop("nodes")),
    "nodes not a list": _edit_graph(lambda doc: doc.update(nodes={"a": 1})),
    "inputs hold an int": _edit_graph(lambda doc: doc.update(inputs=[3])),
    "weights names a missing weight": _edit_graph(lambda doc: doc["weights"].append("ghost")),
    "unknown op": _edit_graph(_node(0, op="NoSuchOp")),
    "op not a string": _edit_graph(_node(0, op=12)),
    "node inputs missing": _edit_graph(lambda doc: doc["nodes"][1].pop("inputs")),
    "node reads a tensor nobody makes": _edit_graph(_node(2, inputs=["nowhere"])),
    "node params not an object": _edit_graph(_node(0, params=[1, 2])),
    "unknown params field": _edit_graph(_param(0, "no_such_field", 1)),
    "params value of the wrong kind": _edit_graph(_param(0, "eps", "tiny")),
    "params value an object": _edit_graph(_param(0, "eps", {"what": 1})),
    "params unknown dtype": _edit_graph(_param(0, "eps", {"dtype": "FP99"})),
    "params float not a float": _edit_graph(_param(0, "eps", {"float": "abc"})),
    "desc shape negative": _edit_graph(lambda doc: doc["descs"][0].update(shape=[-2, H])),
    "desc dtype unknown": _edit_graph(lambda doc: doc["descs"][0].update(dtype="FP99")),
    "desc not an object": _edit_graph(lambda doc: doc["descs"].append("x")),
    # graph_op.json
    "graph_op.json truncated": _truncate("graph_op.json", 0.5),
    "graph_op.json not UTF-8": _replace("graph_op.json", b'{"name": "\xff"}'),
    "graph_op.json a list": _replace("graph_op.json", b"[]"),
    "num_streams not an int": _edit_meta(lambda m: m.update(num_streams="two")),
    "num_streams 0": _edit_meta(lambda m: m.update(num_streams=0)),
    "fusion_config a list": _edit_meta(lambda m: m.update(fusion_config=[1])),
    "fusion_config unknown key": _edit_meta(lambda m: m.update(fusion_config={"x": 1})),
    "dynamic_shape value a string": _edit_meta(lambda m: m.update(dynamic_shape={"s": "x"})),
    "graph_op.json nested 100000 deep": _replace("graph_op.json", b"[" * 100_000),
}


@pytest.mark.parametrize("name", list(DAMAGE))
def test_a_damaged_directory_raises_atb_error(saved, tmp_path, name):
    src, x, _ = saved
    d = tmp_path / "damaged"
    shutil.copytree(src, d)
    DAMAGE[name](d)
    with pytest.raises(AtbError) as ei:
        GraphOp.load(d)(x)  # loading, or at the latest building the plan, refuses it
    assert isinstance(ei.value, GraphError) or "graph_op.json" not in name, ei.value
    if "graph_op.json" not in name and "num_streams" not in name and "fusion" not in name \
            and "dynamic_shape" not in name:
        with pytest.raises(GraphError, match=str(d)):
            load_graph(d)


def test_the_pristine_directory_loads_and_computes_the_same(saved, tmp_path):
    src, x, y = saved
    np.testing.assert_array_equal(GraphOp.load(src)(x), y)


def test_an_oversized_graph_json_is_refused_unread(saved, monkeypatch):
    src, _, _ = saved
    monkeypatch.setattr(saved_doc, "MAX_JSON_BYTES", 64)
    with pytest.raises(GraphError, match="graph.json size"):
        load_graph(src)
