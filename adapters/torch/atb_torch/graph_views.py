"""What a torch ``GraphOp`` shows of its built core GraphOp (fused graph, memory plan,
launches, explain/dot/mermaid, Chrome trace) and how it is saved and loaded: a mixin
of :class:`atb_torch.graph.GraphOp`, which provides ``_runner``, ``name``,
``core_kwargs``, ``profiler``, ``infer_shape``, ``weight_ids``, ``weight_tensors``,
``core_source``, ``fusion_config`` and ``backend``."""

from __future__ import annotations

import os
from typing import Any, Mapping

from atbcore.errors import GraphError
from atbcore.graph.ir import Graph
from atbcore.graph.sequential import lower_sequential

from .graph_binding import host_array, real_mode

__all__ = ["GraphOpViews"]


class GraphOpViews:
    """Introspection, dynamic-shape ranges and save/load of a torch GraphOp."""

    # ------------------------------------------------------------------ introspection
    @property
    def core(self) -> Any:
        """The core GraphOp (None before the first call)."""
        return self._runner.core

    def _built(self) -> Any:
        if self._runner.core is None:
            raise GraphError(self.name, "graph not built yet", "a first call (or explain(x))",
                             "no graph")
        return self._runner.core

    @property
    def graph(self) -> Graph:
        """The graph after fusion."""
        return self._built().graph

    @property
    def graph_unfused(self) -> Graph:
        return self._built().graph_unfused

    @property
    def last_launches(self) -> int | None:
        return None if self.core is None else self.core.last_launches

    @property
    def memory_plan(self) -> Any:
        return None if self.core is None else self.core.memory_plan

    def explain(self, *inputs: Any) -> str:
        """Nodes before/after fusion, kernels, launches, arena (see the core's)."""
        if inputs:
            self.infer_shape(list(inputs))
        return self._built().explain()

    def to_dot(self, which: str = "after") -> str:
        return self._built().to_dot(which)

    def to_mermaid(self, which: str = "after") -> str:
        return self._built().to_mermaid(which)

    def set_dynamic_shape(self, ranges: Mapping[str, Any]) -> None:
        self.core_kwargs["dynamic_shape"] = dict(ranges)
        if self.core is not None:
            self.core.set_dynamic_shape(ranges)

    def export_trace(self, path: str | os.PathLike) -> str:
        """This GraphOp's per-node profile as Chrome trace JSON."""
        return self.profiler.export_chrome_trace(path)

    def save(self, directory: str | os.PathLike) -> str:
        """Save the unfused graph with the current parameter values (core format)."""
        from atbcore.graph.graph_op import GraphOp as CoreGraphOp

        core = self._built()
        g0 = core.graph_unfused
        ids, params = self.weight_ids(), self.weight_tensors()
        with real_mode():
            src = self.core_source({t: host_array(p) for t, p in zip(ids, params)})
            if not isinstance(src, Graph):
                src = lower_sequential(src, [g0.desc_map[i] for i in g0.inputs], self.name)
        return CoreGraphOp(src, name=self.name, fusion_config=self.fusion_config,
                           backend=self.backend).save(directory)

    @classmethod
    def load(cls, directory: str | os.PathLike, **overrides: Any) -> "Any":
        """A GraphOp module from :meth:`save`'s directory."""
        from atbcore.graph.graph_op import GraphOp as CoreGraphOp

        c = CoreGraphOp.load(directory)
        kw = {"name": c.name, "fusion_config": c.fusion_config, "backend": c.backend}
        kw.update(overrides)
        return cls(c.graph_unfused, **kw)
