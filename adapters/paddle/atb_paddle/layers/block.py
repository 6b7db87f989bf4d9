"""A core ``GraphOp`` kept in step with the Paddle parameters it reads.

:class:`LayerBlock` runs a list of core seed-style layers whose weights are Paddle
parameters of their owner layers; :class:`GraphBlock` runs a given core graph whose
weights are Paddle parameters of the owning ``GraphOp``. Both rebuild the core
GraphOp when a parameter changed (see :mod:`.params`), re-registering plugins and
dynamic-shape ranges, and destroy the old one.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

from atbcore.graph.graph_op import GraphOp as CoreGraphOp
from atbcore.graph.ir import Graph
from atbcore.tensor import TensorDesc, describe, is_tensor

from .params import ParamSet

__all__ = ["Block", "LayerBlock", "GraphBlock"]


class Block:
    """Base: a core GraphOp (re)built on demand; subclasses say how."""

    def __init__(self, name: str | None, fusion_config: Any, backend: str | None,
                 options: dict[str, Any]) -> None:
        self.name = name
        self.fusion_config = fusion_config
        self.backend = backend
        self.options = dict(options)
        self.op: CoreGraphOp | None = None
        self.sig: tuple | None = None
        self.plugins: list[tuple[str, Any]] = []
        self.dynamic: dict[str, Any] | None = None
        self.rebuilds = 0

    # subclasses ---------------------------------------------------------
    def param_sets(self) -> list[ParamSet]:
        raise NotImplementedError

    def prepare(self, inputs: Sequence[Any]) -> None:
        """Create missing parameters and hand the current ones to the core."""
        raise NotImplementedError

    def make(self) -> CoreGraphOp:
        raise NotImplementedError

    # shared -------------------------------------------------------------
    def signature(self) -> tuple:
        return tuple(ps.signature() for ps in self.param_sets())

    def get(self, inputs: Sequence[Any]) -> CoreGraphOp:
        """The core GraphOp for the current parameters (built or rebuilt here)."""
        if self.op is not None and self.signature() == self.sig:
            return self.op
        self.prepare(inputs)
        for ps in self.param_sets():
            ps.watch()
        op = self.make()
        for point, plugin in self.plugins:
            op.register_plugin(point, plugin)
        if self.dynamic is not None:
            op.set_dynamic_shape(self.dynamic)
        if self.op is not None:
            self.op.destroy()
            self.rebuilds += 1
        self.op, self.sig = op, self.signature()
        return op

    def register_plugin(self, point: str, plugin: Any) -> None:
        if self.op is not None:
            self.op.register_plugin(point, plugin)    # validates the point name
        else:
            from atbcore.errors import ParamsError
            from atbcore.plugin import POINTS

            if point not in POINTS:
                raise ParamsError(self.name or "GraphOp", "plugin point", list(POINTS), repr(point))
        self.plugins.append((point, plugin))

    def set_dynamic_shape(self, ranges: Any) -> None:
        self.dynamic = dict(ranges)
        if self.op is not None:
            self.op.set_dynamic_shape(ranges)

    def destroy(self) -> None:
        if self.op is not None:
            self.op.destroy()
        self.op, self.sig = None, None


def _descs(inputs: Sequence[Any]) -> list[TensorDesc]:
    return [x if isinstance(x, TensorDesc) else describe(x) for x in inputs
            if isinstance(x, TensorDesc) or is_tensor(x)]


class LayerBlock(Block):
    """Core layers in sequence; ``owners`` are the Paddle layers holding their weights
    (``owner.core`` is a core layer, ``owner.params`` its :class:`ParamSet`)."""

    def __init__(self, cores: Sequence[Any], owners: Sequence[Any], name: str | None,
                 fusion_config: Any = None, backend: str | None = None, **options: Any) -> None:
        super().__init__(name, fusion_config, backend, options)
        self.cores = list(cores)
        self.owners = list(owners)

    def param_sets(self) -> list[ParamSet]:
        return [o.params for o in self.owners]

    def prepare(self, inputs: Sequence[Any]) -> None:
        from atbcore.graph.sequential import lower_sequential

        for o in self.owners:                        # current parameters into the core layers
            o.push()
        with warnings.catch_warnings():              # the core GraphOp warns when it lowers
            warnings.simplefilter("ignore")
            lower_sequential(self.cores, _descs(inputs), self.name or "graph_op")
        for o in self.owners:                        # weights the lowering created
            if o.params.adopt(o.core.weights()):
                o.push()

    def make(self) -> CoreGraphOp:
        return CoreGraphOp(self.cores, name=self.name, fusion_config=self.fusion_config,
                           backend=self.backend, **self.options)


class GraphBlock(Block):
    """A given core graph; its weights are parameters of ``owner`` (``owner.params``)."""

    def __init__(self, graph: Graph, owner: Any, name: str | None, fusion_config: Any = None,
                 backend: str | None = None, **options: Any) -> None:
        super().__init__(name or graph.name, fusion_config, backend, options)
        self.graph = graph
        self.owner = owner
        owner.params.adopt(dict(graph.weights))

    def param_sets(self) -> list[ParamSet]:
        return [self.owner.params]

    def prepare(self, inputs: Sequence[Any]) -> None:
        self.owner.params.adopt({t: w for t, w in self.graph.weights
                                 if self.owner.params.get(t) is None})

    def make(self) -> CoreGraphOp:
        ps = self.owner.params
        # detached: same memory, no autograd history for the DLPack export
        weights = tuple((t, ps.get(t).detach()) for t, _ in self.graph.weights)
        return CoreGraphOp(self.graph.replace(weights=weights), name=self.name,
                           fusion_config=self.fusion_config, backend=self.backend, **self.options)
