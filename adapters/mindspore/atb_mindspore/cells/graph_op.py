"""``GraphOp([...])`` as a MindSpore Cell.

    import atb_mindspore as atb
    mlp = atb.GraphOp([atb.LayerNorm(eps=1e-5), atb.Linear(out_features=mlp_dim), atb.SiLU(),
                       atb.Linear(out_features=hidden_dim), atb.ResidualAdd()])
    y = mlp(x)                                   # x: mindspore.Tensor [B, S, hidden_dim]
    mindspore.save_checkpoint(mlp, "mlp.ckpt")

The layers are sub-cells (``mlp.layers[1]``); their Parameters, created by the first
call, are named ``<name>.<i>.<weight>`` (``graph_op.1.weight``; a named layer uses
its name instead of ``i``), so ``save_checkpoint`` / ``load_param_into_net`` work as
for any Cell. A core :class:`~atbcore.graph.ir.Graph` (from ``GraphBuilder``) is
accepted too; its weights become Parameters under their graph ids. Everything else
is the core ``GraphOp`` — fusion, bucketed plans, plugins (``register_plugin``),
``explain()``, drawing, ``save``/``load`` — rebuilt whenever a Parameter changes
(:mod:`.block`).

PyNative runs the core directly on MindSpore tensors (zero-copy); GRAPH_MODE runs it
inside a pyfunc custom op on NumPy copies (:mod:`.graph_mode`), with the
Parameters read at run time, so a checkpoint loaded between two graph calls is
used by the second. With ``FlashAttention(kv_cache=True)`` layers, PyNative takes
``kv_cache=`` as the core does; GRAPH_MODE takes the cache tensors explicitly
(``block(x, past_key, past_value)`` returns ``(out, present_key, present_value)``).
"""

from __future__ import annotations

import itertools
from typing import Any, Mapping, Sequence

from atbcore.graph.graph_op import GraphOp as CoreGraphOp
from atbcore.graph.graph_op_io import make_fusion_config
from atbcore.graph.ir import Graph

from .._env import mindspore
from .base import AtbCell, in_pynative
from .block import _UNSET, Block, ParamSlot  # one sentinel for "no kv_cache given"
from .fast_call import FastCall
from .layers import LayerCell, OpNode, wrap_core

__all__ = ["GraphOp"]

_COUNTER = itertools.count()


def _default_name() -> str:
    n = next(_COUNTER)
    return "graph_op" if n == 0 else f"graph_op_{n}"


class GraphOp(AtbCell):
    """A fused, planned block of atb layers (or a core graph) as a MindSpore Cell.

    ``GraphOp(layers_or_graph, name=None, fusion_config=None, backend=None, **options)``
    with the core GraphOp's options (``dim_names``, ``dynamic_shape``, ``profile``,
    ...). Call it like the core GraphOp: ``y = block(x)``; in PyNative also
    ``y, kv = block(x, kv_cache=kv)``."""

    def __init__(self, layers_or_graph: Sequence[Any] | Graph, name: str | None = None,
                 fusion_config: Any = None, backend: str | None = None, **options: Any) -> None:
        super().__init__(name or "GraphOp")
        self.name = name or _default_name()
        make_fusion_config(fusion_config)  # bad keys fail here, not at the first call
        self._core_kw = dict(name=self.name, fusion_config=fusion_config, backend=backend,
                             **options)
        self._graph: Graph | None = None
        ms = mindspore()
        if isinstance(layers_or_graph, Graph):
            self._graph = layers_or_graph
            self.layers = ms.nn.CellList([])
            self._gparams: dict[str, Any] = {}
        else:
            if not isinstance(layers_or_graph, (list, tuple)) or not layers_or_graph:
                # the core names the error (an empty or wrong list)
                CoreGraphOp(layers_or_graph, **self._core_kw)
            self.layers = ms.nn.CellList([wrap_core(l) for l in layers_or_graph])
            self._core_layers = [c.core if isinstance(c, LayerCell) else
                                 OpNode(c.operation.opdef.name, c.operation.params)
                                 for c in self.layers]
            for i, c in enumerate(self.layers):
                if isinstance(c, LayerCell):
                    c.set_prefix(f"{self.name}.{c.core.name or i}.")
        self._block = Block(self._make_core, self._slots, self._pull, self._push,
                            lambda: f"{self.name}.")
        self._pending_kv: Any = _UNSET
        self._fast: FastCall | None = None  # the last plain PyNative call (fast_call.py)

    # ------------------------------------------------------------------ weights
    def _slots(self) -> list[ParamSlot]:
        if self._graph is not None:
            return [ParamSlot(k, lambda k=k: self._gparams.get(k),
                              lambda p, k=k: self._set_gparam(k, p), where=(self._gparams, k))
                    for k, _ in self._graph.weights]
        out = []
        for c in self.layers:
            if isinstance(c, LayerCell):
                out += [ParamSlot(f"{id(c)}:{s.key}", s.get, s.set, s.name, s.where)
                        for s in c.param_slots()]
        return out

    def _set_gparam(self, key: str, p: Any) -> None:
        p.name = f"{self.name}.{key}"
        self._gparams[key] = p
        setattr(self, "g_" + key.replace(".", "__"), p)

    def _pull(self, core: CoreGraphOp) -> dict[str, Any]:
        if self._graph is not None:
            return dict(self._graph.weights)
        out = {}
        for c in self.layers:
            if isinstance(c, LayerCell):
                out.update({f"{id(c)}:{k}": v for k, v in c.core.weights().items()})
        return out

    def _push(self, params: dict[str, Any]) -> None:
        if self._graph is not None:
            if params:
                from atbcore.graph.layers import host_array

                self._graph = self._graph.replace(weights=tuple(
                    (k, host_array(params[k]) if k in params else v) for k, v in self._graph.weights))
            return
        for c in self.layers:
            if isinstance(c, LayerCell):
                mine = {k.split(":", 1)[1]: v for k, v in params.items()
                        if k.startswith(f"{id(c)}:")}
                c.push_weights(mine)

    def _make_core(self) -> CoreGraphOp:
        src = self._graph if self._graph is not None else self._core_layers
        return CoreGraphOp(src, **self._core_kw)

    def refresh_weights(self) -> None:
        """Rebuild from the Parameters at the next call (after in-place writes such
        as ``ops.assign``, which MindSpore does not version)."""
        self._block.refresh()
        self._fast = None

    def build(self, *inputs: Any) -> "GraphOp":
        """Create the Parameters and the graph now, for inputs given as tensors or
        ``TensorDesc`` (e.g. before loading a checkpoint or compiling under jit)."""
        self._block.ensure(self._block.descs(inputs))
        return self

    # ------------------------------------------------------------------ the core
    @property
    def core(self) -> CoreGraphOp | None:
        """The core GraphOp (None before the first call or :meth:`build`)."""
        return self._block.core

    def register_plugin(self, point: str, plugin: Any) -> "GraphOp":
        """Run ``plugin`` at ``point`` (one of ``atbcore.plugin.POINTS``); it sees and
        returns MindSpore tensors (NumPy arrays under ``mindspore.jit`` in PyNative
        mode, where the pyfunc must not issue MindSpore ops)."""
        from atbcore.plugin import POINTS
        from atbcore.errors import ParamsError

        if point not in POINTS:
            raise ParamsError(self.name, "plugin point", list(POINTS), repr(point))
        self._block.replay(lambda core: core.register_plugin(point, plugin))
        self._fast = None
        return self

    def set_dynamic_shape(self, ranges: Mapping[str, Any]) -> None:
        """Declare dynamic dim ranges (see ``atbcore.runtime.plan_cache``)."""
        self._core_kw["dynamic_shape"] = dict(ranges)
        self._block.replay(lambda core: core.set_dynamic_shape(ranges))
        self._fast = None

    def explain(self, *inputs: Any) -> str:
        """The core's explanation (nodes before/after fusion, kernels, fallbacks)."""
        if inputs:
            self.build(*inputs)
        self._need_core()
        return self.core.explain(*inputs)

    def to_dot(self, which: str = "after") -> str:
        self._need_core()
        return self.core.to_dot(which)

    def to_mermaid(self, which: str = "after") -> str:
        self._need_core()
        return self.core.to_mermaid(which)

    def save(self, directory: Any) -> str:
        """Save the core graph (with the current weights) and settings."""
        self._need_core()
        self._block.ensure(self._block._descs or [])
        return self.core.save(directory)

    @classmethod
    def load(cls, directory: Any, **overrides: Any) -> "GraphOp":
        """A GraphOp Cell from :meth:`save`'s directory; the weights become Parameters."""
        core = CoreGraphOp.load(directory, **overrides)
        return cls(core.graph_unfused, name=core.name, fusion_config=core.fusion_config,
                   backend=core.backend)

    @property
    def last_launches(self) -> int | None:
        return self.core.last_launches if self.core else None

    @property
    def memory_plan(self) -> Any:
        return self.core.memory_plan if self.core else None

    def _need_core(self) -> None:
        if self.core is None:
            from atbcore.errors import GraphError

            raise GraphError(self.name, "graph not built yet",
                             "a first call (or build(x)) before this", "no graph")

    # ------------------------------------------------------------------ running
    def __call__(self, *inputs: Any, kv_cache: Any = _UNSET) -> Any:
        fast = self._fast
        if fast is not None and kv_cache is _UNSET:
            outs = fast(self, inputs)
            if outs is not None:
                return outs[0] if len(outs) == 1 else tuple(outs)
        if kv_cache is not _UNSET:
            if not in_pynative():
                from atbcore.errors import CapabilityError

                raise CapabilityError(self.name, "kv_cache= in GRAPH_MODE",
                                      "the cache tensors as explicit inputs", "kv_cache=")
            self._pending_kv = kv_cache
        try:
            out = super().__call__(*inputs)
        finally:
            self._pending_kv = _UNSET
        if kv_cache is _UNSET and in_pynative():
            self._fast = FastCall.after(self, inputs)
        return out

    def prepare(self, xs: Sequence[Any]) -> None:
        self._block.ensure(self._block._descs if self.core is not None and self._block._descs
                           else self._block.descs(xs))

    def forward(self, *xs: Any) -> Any:
        return self._block.call(xs, self._pending_kv)

    def run_graph(self, arrays):
        return self._block.execute(arrays)

    def infer(self, descs):
        return self._block.infer(descs)

    def destroy(self) -> None:
        """Free the core's plans and arenas."""
        if self.core is not None:
            self.core.destroy()
        self._fast = None

