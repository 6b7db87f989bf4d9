"""Validation of a saved graph's JSON files before anything is built from them.

``graph.json`` and ``graph_op.json`` come from disk, so every field is checked for
its type and range (ids are strings, shapes non-negative ints, dtypes and ops
known, params values of the saved kinds) and the document for its size and
nesting depth; what does not fit raises :class:`~atbcore.errors.GraphError` naming
the directory and the field, never a KeyError or RecursionError from deep inside.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..dtypes import Dtype
from ..errors import GraphError

__all__ = ["MAX_JSON_BYTES", "MAX_DEPTH", "read_json", "check_graph_doc", "check_meta_doc"]

MAX_JSON_BYTES = 256 << 20  # a graph of 10^5 nodes is a few tens of MiB
MAX_DEPTH = 32              # graph.json nests ~8 deep; params values hold flat tuples
_MAX_DIM = 1 << 48


def read_json(where: str, path: str, what: str) -> Any:
    """The parsed JSON file ``path`` (UTF-8, at most MAX_JSON_BYTES, nested at most
    MAX_DEPTH), or GraphError."""
    try:
        size = os.path.getsize(path)
        if size > MAX_JSON_BYTES:
            raise GraphError(where, f"{what} size", f"<= {MAX_JSON_BYTES} bytes", size)
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
        doc = json.loads(text)
    except GraphError:
        raise
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise GraphError(where, f"cannot read {what}", "a UTF-8 JSON file written by atb",
                         f"{type(e).__name__}: {str(e)[:200]}") from e
    _depth(where, what, doc)
    return doc


def _depth(where: str, what: str, doc: Any) -> None:
    stack = [(doc, 1)]  # iterative: a deep document must not exhaust the C stack
    while stack:
        v, d = stack.pop()
        if d > MAX_DEPTH:
            raise GraphError(where, f"{what} nesting depth", f"<= {MAX_DEPTH}", f"> {MAX_DEPTH}")
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)


def _need(where: str, field: str, v: Any, kind: type | tuple, what: str) -> Any:
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise GraphError(where, f"field {field!r}", what, f"{type(v).__name__} {v!r}"[:120])
    return v


def _ids(where: str, field: str, v: Any) -> list[str]:
    _need(where, field, v, list, "a list of tensor ids (strings)")
    for x in v:
        _need(where, field, x, str, "a list of tensor ids (strings)")
    return v


def _value(where: str, field: str, v: Any) -> None:
    """A params value as :func:`.serialize._enc` writes them."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return
    if isinstance(v, list):
        for x in v:
            _value(where, field, x)
        return
    if isinstance(v, dict) and set(v) == {"dtype"} and v["dtype"] in Dtype.__members__:
        return
    if isinstance(v, dict) and set(v) == {"float"} and v["float"] in ("inf", "-inf", "nan"):
        return
    raise GraphError(where, f"params value {field!r}", "bool/int/float/str/null, a list of "
                     "them, {\"dtype\": NAME} or {\"float\": \"inf\"|\"-inf\"|\"nan\"}",
                     repr(v)[:120])


def check_graph_doc(where: str, doc: Any, version: int) -> None:
    """Every field of a ``graph.json`` document, or GraphError."""
    from ..ops.registry import list_operations, get_op

    _need(where, "graph.json", doc, dict, "a JSON object")
    if doc.get("format") != "atb-graph" or doc.get("version") != version:
        raise GraphError(where, "graph file format", f"atb-graph version {version}",
                         f"{doc.get('format')!r} version {doc.get('version')!r}"[:120])
    for key in ("name", "inputs", "outputs", "weights", "descs", "nodes"):
        if key not in doc:
            raise GraphError(where, f"field {key!r}", "present", "missing")
    _need(where, "name", doc["name"], str, "a string")
    for key in ("inputs", "outputs", "weights"):
        _ids(where, key, doc[key])
    _need(where, "descs", doc["descs"], list, "a list of tensor descriptors")
    for i, d in enumerate(doc["descs"]):
        f = f"descs[{i}]"
        _need(where, f, d, dict, "an object {id, shape, dtype, format, device}")
        _need(where, f + ".id", d.get("id"), str, "a tensor id")
        shape = _need(where, f + ".shape", d.get("shape"), list, "a list of ints >= 0")
        if any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= _MAX_DIM
               for n in shape):
            raise GraphError(where, f"field {f + '.shape'!r}", f"ints in [0, {_MAX_DIM}]",
                             repr(shape)[:120])
        if d.get("dtype") not in Dtype.__members__:
            raise GraphError(where, f"field {f + '.dtype'!r}", sorted(Dtype.__members__),
                             repr(d.get("dtype"))[:60])
        _need(where, f + ".format", d.get("format"), str, "a string")
        _need(where, f + ".device", d.get("device"), str, "a string")
    _need(where, "nodes", doc["nodes"], list, "a list of nodes")
    known = {n.lower() for n in list_operations()}
    for i, n in enumerate(doc["nodes"]):
        f = f"nodes[{i}]"
        _need(where, f, n, dict, "an object {name, op, params, inputs, outputs}")
        _need(where, f + ".name", n.get("name"), str, "a string")
        op = _need(where, f + ".op", n.get("op"), str, "an op name")
        if op.lower() not in known:
            try:
                get_op(op)  # aliases
            except Exception:  # noqa: BLE001 - any failure is an unknown op here
                raise GraphError(where, f"field {f + '.op'!r}", "a registered op",
                                 repr(op)[:60]) from None
        _ids(where, f + ".inputs", n.get("inputs"))
        _ids(where, f + ".outputs", n.get("outputs"))
        params = _need(where, f + ".params", n.get("params"), dict,
                       "an object {fields, hints}")
        for part in ("fields", "hints"):
            vals = params.get(part) or {}
            _need(where, f"{f}.params.{part}", vals, dict, "an object of params values")
            for k, v in vals.items():
                _value(where, f"{f}.params.{part}.{k}", v)


def check_meta_doc(where: str, meta: Any) -> None:
    """The fields of a ``graph_op.json`` (GraphOp settings), or GraphError."""
    _need(where, "graph_op.json", meta, dict, "a JSON object")
    kinds: dict[str, tuple[tuple, str]] = {
        "name": ((str, type(None)), "a string or null"),
        "backend": ((str, type(None)), "a string or null"),
        "fusion_config": ((dict, type(None)), "an object or null"),
        "dim_names": ((dict, list, type(None)), "an object, a list or null"),
        "dynamic_shape": ((dict, type(None)), "an object or null"),
        "num_streams": ((int,), "an int >= 1"),
        "arena": ((str,), "a string"),
    }
    for key, (kind, what) in kinds.items():
        if key in meta:
            _need(where, key, meta[key], kind, what)
    if "num_streams" in meta and (isinstance(meta["num_streams"], bool)
                                  or not 1 <= meta["num_streams"] <= 1024):
        raise GraphError(where, "field 'num_streams'", "an int in [1, 1024]",
                         repr(meta["num_streams"]))
    for k, v in (meta.get("dynamic_shape") or {}).items():
        if not isinstance(v, (int, list)) or isinstance(v, bool) or (
                isinstance(v, list) and not all(isinstance(x, int) and not isinstance(x, bool)
                                                for x in v)):
            raise GraphError(where, f"field 'dynamic_shape.{k}'", "an int or a list of ints",
                             repr(v)[:80])
