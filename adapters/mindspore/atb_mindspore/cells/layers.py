"""The seed-style layers as MindSpore Cells with Parameters:

    import atb_mindspore as atb
    ln = atb.LayerNorm(eps=1e-5)
    y = ln(x)                       # weights created at the first call: ln.weight, ln.bias
    fc = atb.Linear(out_features=1024)

Each Cell wraps the core layer of the same name (``atbcore.graph.layers``) and owns
its weights as Parameters, created when the first call (alone, or inside a
``GraphOp``) tells the input shape; they are named by the core's weight names
(``weight``, ``bias``, ``q_proj.weight`` ...) under the Cell's prefix. Called
alone, a layer runs as a one-layer GraphOp. Any single-input op Cell
(``atb.ops.Softmax()``) can stand in a GraphOp list too (:class:`OpNode`).
"""

from __future__ import annotations

from typing import Any, Sequence

from atbcore.errors import ParamsError
from atbcore.graph import layers as core_layers
from atbcore.graph.graph_op import GraphOp as CoreGraphOp
from atbcore.graph.layers import Layer as CoreLayer

from .base import AtbCell
from .block import Block, ParamSlot

__all__ = ["LayerCell", "OpNode", "SEED_LAYERS", "wrap_core"]



def _attr(key: str) -> str:
    # Cell attributes cannot hold dots; Parameter names keep the core's dotted names
    return "p_" + key.replace(".", "__")


class OpNode(CoreLayer):
    """A core layer that applies one op to the running tensor (used for op Cells
    placed in a GraphOp list)."""

    kind = "op"

    def __init__(self, op: str, params: Any, name: str | None = None) -> None:
        super().__init__(name)
        self.op, self.op_params = op, params

    def lower(self, ctx: Any, x: str) -> str:
        return ctx.builder.add_node(self.op, [x], self.op_params, name=ctx.name_of(self))[0]


class LayerCell(AtbCell):
    """A core seed-style layer as a Cell (see the module doc). ``core`` is the core
    layer; the Parameters mirror ``core.weights()``."""

    core_class: type = CoreLayer

    def __init__(self, *args: Any, core: CoreLayer | None = None, **kw: Any) -> None:
        layer = core if core is not None else self.core_class(*args, **kw)
        super().__init__(type(self).__name__)
        self.core = layer
        self._prefix = (layer.name or layer.kind) + "."
        self._block = Block(self._make_core, self.param_slots, lambda c: self.core.weights(),
                            self.push_weights, lambda: self._prefix)

    # ------------------------------------------------------------------ weights
    def weight_keys(self) -> list[str]:
        """The core layer's weight names (known once the shapes are)."""
        return sorted(set(self.core._weight_names()))

    def param_slots(self) -> list[ParamSlot]:
        return [ParamSlot(k, lambda k=k: getattr(self, _attr(k), None),
                          lambda p, k=k: self._set_param(k, p), self._prefix + k,
                          (self._params, _attr(k)))  # where a Cell keeps its Parameters
                for k in self.weight_keys()]

    def _set_param(self, key: str, p: Any) -> None:
        setattr(self, _attr(key), p)

    def param(self, key: str) -> Any:
        """The Parameter of weight ``key`` (``"weight"``, ``"q_proj.weight"``), or None."""
        return getattr(self, _attr(key), None)

    def push_weights(self, params: dict[str, Any]) -> None:
        """Hand Parameters to the core layer (NumPy views of their memory)."""
        if params:
            self.core.load_weights(params)

    def refresh_weights(self) -> None:
        """Rebuild from the Parameters at the next call (after in-place writes)."""
        self._block.refresh()

    def set_prefix(self, prefix: str) -> None:
        """Name the Parameters ``<prefix><weight name>``."""
        self._prefix = prefix
        self._block.rename()

    # ------------------------------------------------------------------ running
    def _make_core(self) -> CoreGraphOp:
        return CoreGraphOp([self.core], name=self.core.name or self.core.kind)

    def prepare(self, xs: Sequence[Any]) -> None:
        self._block.ensure(self._block.descs(xs))

    def forward(self, *xs: Any) -> Any:
        return self._block.call(xs)

    def run_graph(self, arrays):
        return self._block.execute(arrays)

    def infer(self, descs):
        return self._block.infer(descs)

    @property
    def graph_op(self) -> CoreGraphOp | None:
        """The one-layer core GraphOp (after the first call)."""
        return self._block.core


def _layer_class(name: str, core_cls: type) -> type:
    doc = (core_cls.__doc__ or "").strip()
    return type(name, (LayerCell,), {"core_class": core_cls, "__module__": "atb_mindspore",
                                     "__doc__": f"{doc}\n\nA MindSpore Cell with Parameters "
                                                "(see :mod:`atb_mindspore.cells.layers`)."})


SEED_LAYERS: dict[str, type] = {
    n: _layer_class(n, getattr(core_layers, n)) for n in core_layers.__all__
    if n not in ("Layer", "host_array") and isinstance(getattr(core_layers, n), type)
}


def wrap_core(layer: Any) -> AtbCell:
    """A Cell for ``layer``: a LayerCell stays, a core Layer is wrapped, a single-
    input op Cell is accepted as is (it lowers through :class:`OpNode`)."""
    from .op_cell import OpCell

    if isinstance(layer, (LayerCell, OpCell)):
        return layer
    if isinstance(layer, CoreLayer):
        cls = SEED_LAYERS.get(type(layer).__name__, LayerCell)
        return cls(core=layer)
    raise ParamsError("GraphOp", "layer", "an atb layer (atb_mindspore.Linear, LayerNorm, ...), "
                      "a core layer or an op Cell", type(layer).__name__)
