"""Saving and loading graphs: a directory with ``graph.json`` + ``weights.safetensors``.

    save_graph(g, "out/")          # out/graph.json, out/weights.safetensors
    g2 = load_graph("out/")        # g2 == g, weights bit-exact

``graph.json`` holds the structure: name, inputs, outputs, descriptors, and per
node its op, params (by field name; a Dtype by its name, ``{"dtype": "FP16"}``;
tuples as lists), the advisory hints and the tensor ids. Weights go to a standard
safetensors file keyed by weight id, in their own dtype (bf16 included), written
and read by the ``safetensors`` library, so the round trip is bit-exact and no
offset in a file is trusted. A loaded ``graph.json`` is validated before use
(size, nesting depth, the type of every field, known ops and params): every
damaged directory raises GraphError naming what is wrong.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

from ..dtypes import Dtype
from ..errors import AtbError, GraphError
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
_ST_BY_NAME = {np.dtype(k.numpy).name: k for k in _ST}  # safetensors >= 0.8 spells these


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
    _check_kinds(cls, fields, op, where)
    try:
        p = cls(**fields)
    except AtbError:
        raise
    except Exception as e:  # a params constructor's own check (TypeError, ValueError, ...)
        raise GraphError(where, f"saved params of {op}", "values the op accepts",
                         f"{type(e).__name__}: {str(e)[:200]}") from e
    hints = data.get("hints") or {}
    if hints:
        object.__setattr__(p, "_hints", tuple(sorted((k, _dec(v)) for k, v in hints.items())))
    return p


def _kind(v: Any) -> str | None:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    for cls, name in ((str, "str"), (tuple, "tuple"), (Dtype, "Dtype")):
        if isinstance(v, cls):
            return name
    return None


# the kinds a field may hold, by the kind of its default: ints and tuples stand in for
# each other (``dim: int | tuple``), strings and bools only for themselves
_KINDS_OK = {"number": ("number", "tuple"), "tuple": ("tuple", "number"), "bool": ("bool",),
             "str": ("str",), "Dtype": ("Dtype",)}


def _check_kinds(cls: type, fields: dict[str, Any], op: str, where: str) -> None:
    """Each saved value of the kind of its field's default (a number, bool, str, tuple,
    Dtype), so a damaged file cannot put a string where the op computes with a float.
    Fields without a default, or defaulting to None, take what the op's own checks take."""
    for f in dataclasses.fields(cls):
        if f.name not in fields or fields[f.name] is None:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            continue
        want = _KINDS_OK.get(_kind(default))
        if want is not None and _kind(fields[f.name]) not in want:
            raise GraphError(where, f"saved params field {f.name!r} of {op}",
                             " or ".join(f"a {k}" for k in want), repr(fields[f.name])[:80])


def _desc_json(tid: str, d: TensorDesc) -> dict[str, Any]:
    return {"id": tid, "shape": list(d.shape), "dtype": d.dtype.name, "format": d.format,
            "device": d.device}


# ----------------------------------------------------------------------------- safetensors
def write_safetensors(path: str | os.PathLike, tensors: list[tuple[str, np.ndarray]]) -> None:
    """A safetensors file of NumPy arrays (any of atb's dtypes, bf16 included),
    written by the ``safetensors`` library."""
    import safetensors

    keep = [np.ascontiguousarray(a) for _, a in tensors]  # alive while the specs point in
    specs: dict[str, Any] = {}
    for (key, _), a in zip(tensors, keep):
        dt = Dtype.of(a.dtype)
        if hasattr(safetensors, "TensorSpec"):  # safetensors >= 0.8: addresses, numpy names
            specs[key] = safetensors.TensorSpec(dtype=a.dtype.name, shape=list(a.shape),
                                                data_ptr=a.ctypes.data, data_len=a.nbytes)
        else:
            specs[key] = {"dtype": _ST[dt], "shape": list(a.shape), "data": a.tobytes()}
    safetensors.serialize_file(specs, os.fspath(path), metadata={"format": "atb"})
    del keep


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Arrays of a safetensors file by key, parsed and checked by the ``safetensors``
    library (header, offsets inside the file, no overlap or gap, sizes that match
    dtype and shape); GraphError for a damaged or unreadable file."""
    import safetensors

    where = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
        items = safetensors.deserialize(data)
    except (OSError, safetensors.SafetensorError) as e:
        raise GraphError(where, "cannot read the weights", "a valid safetensors file",
                         f"{type(e).__name__}: {e}") from e
    except Exception as e:  # the Rust binding reports some damage as other errors
        raise GraphError(where, "cannot read the weights", "a valid safetensors file",
                         f"{type(e).__name__}: {e}") from e
    out = {}
    for key, info in items:
        tag = str(info["dtype"])
        dt = _ST_BACK.get(tag.upper()) or _ST_BY_NAME.get(tag.lower())
        if dt is None:
            raise GraphError(where, f"weight {key!r} dtype", sorted(_ST_BACK), tag)
        shape = tuple(int(n) for n in info["shape"])
        raw = info["data"]
        if len(raw) != math.prod(shape) * dt.itemsize:  # the library checks; never trust
            raise GraphError(where, f"weight {key!r} size", math.prod(shape) * dt.itemsize,
                             len(raw))
        out[key] = np.frombuffer(bytes(raw), dtype=dt.numpy).reshape(shape).copy()
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
    """The graph :func:`save_graph` wrote. A damaged directory (missing or truncated
    files, bad JSON, fields of the wrong kind, unknown ops or params, damaged
    weights) raises :class:`GraphError` naming the directory and what is wrong."""
    from .saved_doc import check_graph_doc, read_json
    from .verify import check_structure

    where = os.fspath(directory)
    doc = read_json(where, os.path.join(directory, GRAPH_FILE), GRAPH_FILE)
    check_graph_doc(where, doc, FORMAT_VERSION)
    arrays = read_safetensors(os.path.join(directory, WEIGHTS_FILE))
    missing = [w for w in doc["weights"] if w not in arrays]
    if missing:
        raise GraphError(where, f"weight {missing[0]!r} missing from {WEIGHTS_FILE}",
                         "every weight of the graph", missing[:8])
    name = doc["name"]
    try:
        nodes = tuple(Node(n["name"], n["op"], _params_back(
            n["op"], n["params"], f"{where}: node {name}/{n['name']}"),
            tuple(n["inputs"]), tuple(n["outputs"])) for n in doc["nodes"])
        descs = tuple((d["id"], TensorDesc(d["shape"], d["dtype"], d["format"], d["device"]))
                      for d in doc["descs"])
        graph = Graph(name, tuple(doc["inputs"]), tuple(doc["outputs"]), nodes,
                      tuple((w, arrays[w]) for w in doc["weights"]), descs=descs)
        check_structure(graph)  # dangling ids, tensors made twice, cycles
        return graph
    except AtbError as e:
        if where in str(e):
            raise
        raise GraphError(where, "saved graph", "a well-formed graph", str(e)[:300]) from e
    except Exception as e:  # a value the checks let through that an op or the IR refuses
        raise GraphError(where, "saved graph", "a graph atb can rebuild",
                         f"{type(e).__name__}: {str(e)[:200]}") from e
