"""Saving and loading graphs: a directory with ``graph.json`` + ``weights.safetensors``.

    save_graph(g, "out/")          # out/graph.json, out/weights.safetensors
    g2 = load_graph("out/")        # g2 == g, weights bit-exact

``graph.json`` holds the structure: name, inputs, outputs, descriptors, and per
node its op, params (by field name; a Dtype by its name, ``{"dtype": "FP16"}``;
tuples as lists), the advisory hints and the tensor ids. Weights go to a standard
safetensors file keyed by weight id, in their own dtype (bf16 included), written
and read here byte for byte, so the round trip is bit-exact; any safetensors
reader opens the file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from typing import Any

import numpy as np

from ..dtypes import Dtype
from ..errors import GraphError
from ..ops.base import Params
from ..ops.registry import get_op
from ..tensor import TensorDesc
from .ir import Graph, Node
from .layers import host_array

__all__ = ["save_graph", "load_graph", "GRAPH_FILE", "WEIGHTS_FILE", "FORMAT_VERSION",
           "write_safetensors", "read_safetensors"]

GRAPH_FILE = "graph.json"
WEIGHTS_FILE = "weights.safetensors"
FORMAT_VERSION = 1

# safetensors dtype tags
_ST = {Dtype.FP32: "F32", Dtype.FP16: "F16", Dtype.BF16: "BF16", Dtype.FP64: "F64",
       Dtype.INT8: "I8", Dtype.UINT8: "U8", Dtype.INT32: "I32", Dtype.INT64: "I64",
       Dtype.BOOL: "BOOL"}
_ST_BACK = {v: k for k, v in _ST.items()}


# ----------------------------------------------------------------------------- values
def _enc(v: Any, where: str) -> Any:
    if isinstance(v, Dtype):
        return {"dtype": v.name}
    if isinstance(v, (bool, str)) or v is None:
        return v
    if isinstance(v, (np.bool_,)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        f = float(v)
        return f if math.isfinite(f) else {"float": repr(f)}
    if isinstance(v, (tuple, list)):
        return [_enc(x, where) for x in v]
    raise GraphError(where, "a params value cannot be saved", "bool/int/float/str/None/Dtype/"
                     "tuple", f"{type(v).__name__} {v!r}"[:80])


def _dec(v: Any) -> Any:
    if isinstance(v, dict):
        if "dtype" in v:
            return Dtype[v["dtype"]]
        if "float" in v:
            return float(v["float"])
    if isinstance(v, list):
        return tuple(_dec(x) for x in v)
    return v


def _params_json(node: Node, graph: str) -> dict[str, Any]:
    where = f"{graph}/{node.name}"
    fields = {f.name: _enc(getattr(node.params, f.name), where)
              for f in dataclasses.fields(node.params)}
    return {"fields": fields, "hints": {k: _enc(v, where) for k, v in node.params.hints.items()}}


def _params_back(op: str, data: dict[str, Any], where: str) -> Params:
    cls = get_op(op).Params
    known = {f.name for f in dataclasses.fields(cls)}
    fields = {k: _dec(v) for k, v in data.get("fields", {}).items()}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise GraphError(where, f"saved params field {unknown[0]!r} unknown to {op}",
                         f"fields {sorted(known)}", unknown)
    p = cls(**fields)
    hints = data.get("hints") or {}
    if hints:
        object.__setattr__(p, "_hints", tuple(sorted((k, _dec(v)) for k, v in hints.items())))
    return p


def _desc_json(tid: str, d: TensorDesc) -> dict[str, Any]:
    return {"id": tid, "shape": list(d.shape), "dtype": d.dtype.name, "format": d.format,
            "device": d.device}


# ----------------------------------------------------------------------------- safetensors
def write_safetensors(path: str | os.PathLike, tensors: list[tuple[str, np.ndarray]]) -> None:
    """A safetensors file of NumPy arrays (any of atb's dtypes, bf16 included)."""
    header: dict[str, Any] = {"__metadata__": {"format": "atb"}}
    blobs, offset = [], 0
    for key, a in tensors:
        a = np.ascontiguousarray(a)
        dt = Dtype.of(a.dtype)
        raw = a.tobytes()
        header[key] = {"dtype": _ST[dt], "shape": list(a.shape),
                       "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Arrays of a safetensors file by key (in file order)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dt = _ST_BACK.get(info["dtype"])
        if dt is None:
            raise GraphError(os.fspath(path), f"weight {key!r} dtype", sorted(_ST_BACK),
                             info["dtype"])
        a, b = info["data_offsets"]
        out[key] = np.frombuffer(data[base + a:base + b], dtype=dt.numpy).reshape(
            info["shape"]).copy()
    return out


# ----------------------------------------------------------------------------- graphs
def save_graph(graph: Graph, directory: str | os.PathLike) -> str:
    """Write ``graph`` to ``directory`` (created if needed); returns its path."""
    os.makedirs(directory, exist_ok=True)
    doc = {
        "format": "atb-graph", "version": FORMAT_VERSION, "name": graph.name,
        "inputs": list(graph.inputs), "outputs": list(graph.outputs),
        "weights": [w for w, _ in graph.weights],
        "descs": [_desc_json(t, d) for t, d in graph.descs],
        "nodes": [{"name": n.name, "op": n.op, "params": _params_json(n, graph.name),
                   "inputs": list(n.inputs), "outputs": list(n.outputs)} for n in graph.nodes],
    }
    with open(os.path.join(directory, GRAPH_FILE), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    write_safetensors(os.path.join(directory, WEIGHTS_FILE),
                      [(w, host_array(a)) for w, a in graph.weights])
    return os.fspath(directory)


def load_graph(directory: str | os.PathLike) -> Graph:
    """The graph :func:`save_graph` wrote (GraphError for a damaged directory)."""
    path = os.path.join(directory, GRAPH_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise GraphError(os.fspath(directory), f"cannot read {GRAPH_FILE}", "a saved graph",
                         str(e)) from e
    if doc.get("format") != "atb-graph" or doc.get("version") != FORMAT_VERSION:
        raise GraphError(os.fspath(directory), "graph file format",
                         f"atb-graph version {FORMAT_VERSION}",
                         f"{doc.get('format')} version {doc.get('version')}")
    arrays = read_safetensors(os.path.join(directory, WEIGHTS_FILE))
    missing = [w for w in doc["weights"] if w not in arrays]
    if missing:
        raise GraphError(os.fspath(directory), f"weight {missing[0]!r} missing from {WEIGHTS_FILE}",
                         "every weight of the graph", missing)
    name = doc["name"]
    nodes = tuple(Node(n["name"], n["op"], _params_back(n["op"], n["params"], f"{name}/{n['name']}"),
                       tuple(n["inputs"]), tuple(n["outputs"])) for n in doc["nodes"])
    descs = tuple((d["id"], TensorDesc(d["shape"], d["dtype"], d["format"], d["device"]))
                  for d in doc["descs"])
    return Graph(name, tuple(doc["inputs"]), tuple(doc["outputs"]), nodes,
                 tuple((w, arrays[w]) for w in doc["weights"]), descs=descs)
