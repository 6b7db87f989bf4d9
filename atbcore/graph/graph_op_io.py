"""GraphOp settings in and out: the fusion config (a ``FusionConfig`` or the seed's
dict) and save/load of a GraphOp (the graph before fusion through
``atbcore.graph.serialize`` + a ``graph_op.json`` of its settings)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from ..errors import ParamsError

__all__ = ["make_fusion_config", "save_graph_op", "load_graph_op_kwargs", "META_FILE"]

# Keys of the seed's fusion_config that tune nothing we model; accepted and kept.
_SEED_ONLY_KEYS = frozenset({"memory_optimization"})
META_FILE = "graph_op.json"


def make_fusion_config(cfg: Any) -> tuple[Any, dict[str, Any]]:
    """A FusionConfig from None, a FusionConfig or a dict of its/the seed's keys;
    returns (config, seed-only keys that were accepted without effect)."""
    from ..passes.pipeline import FusionConfig

    if cfg is None:
        return FusionConfig(), {}
    if isinstance(cfg, FusionConfig):
        return cfg, {}
    if not isinstance(cfg, Mapping):
        raise ParamsError("GraphOp", "fusion_config", "a FusionConfig or a dict",
                          type(cfg).__name__)
    fields = {f.name for f in dataclasses.fields(FusionConfig)}
    extra = {k: v for k, v in cfg.items() if k not in fields}
    unknown = sorted(k for k in extra if k not in _SEED_ONLY_KEYS)
    if unknown:
        raise ParamsError("GraphOp", f"unknown fusion_config key {unknown[0]!r}",
                          f"one of {sorted(fields | _SEED_ONLY_KEYS)}", repr(unknown[0]))
    return FusionConfig(**{k: v for k, v in cfg.items() if k in fields}), extra


def save_graph_op(op: Any, directory: str | os.PathLike) -> str:
    """Write ``op``'s graph before fusion and its settings into ``directory``."""
    from .serialize import save_graph

    graph = op._graphs("before")
    os.makedirs(directory, exist_ok=True)
    save_graph(graph, directory)
    meta = {"name": op.name, "backend": op.backend,
            "fusion_config": dataclasses.asdict(op.fusion_config),
            "dim_names": op.dim_names, "dynamic_shape": op._dynamic,
            "num_streams": op.num_streams, "arena": op.arena}
    with open(os.path.join(directory, META_FILE), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, default=list)
    return os.fspath(directory)


def load_graph_op_kwargs(directory: str | os.PathLike, overrides: Mapping[str, Any]
                         ) -> dict[str, Any]:
    """Constructor arguments of the GraphOp saved in ``directory`` (GraphError for a
    damaged one)."""
    from .serialize import load_graph

    from .saved_doc import check_meta_doc, read_json

    graph = load_graph(directory)
    meta: dict[str, Any] = {}
    path = os.path.join(directory, META_FILE)
    if os.path.exists(path):
        meta = read_json(os.fspath(directory), path, META_FILE)
        check_meta_doc(os.fspath(directory), meta)
    kw: dict[str, Any] = {
        "layers_or_graph": graph, "name": meta.get("name"), "backend": meta.get("backend"),
        "fusion_config": meta.get("fusion_config"), "dim_names": meta.get("dim_names"),
        "dynamic_shape": {k: tuple(v) if isinstance(v, list) else v
                          for k, v in (meta.get("dynamic_shape") or {}).items()},
        "num_streams": meta.get("num_streams", 1), "arena": meta.get("arena", "auto")}
    kw.update(overrides)
    return kw
