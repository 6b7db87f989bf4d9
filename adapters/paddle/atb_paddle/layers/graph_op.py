"""``GraphOp([...])`` as a ``paddle.nn.Layer``.

    import atb_paddle as atb
    mlp = atb.GraphOp([atb.LayerNorm(eps=1e-5), atb.Linear(out_features=mlp_dim), atb.SiLU(),
                       atb.Linear(out_features=hidden_dim), atb.ResidualAdd()])
    y = mlp(x)                              # x: paddle.Tensor [B, S, hidden_dim]
    paddle.save(mlp.state_dict(), "mlp.pdparams")

The layers are its sublayers (named by their given name, else their position), so
``state_dict()`` reads ``1.weight``, ``1.bias`` ... once the first call created the
weights; ``set_state_dict`` loads them back. A core :class:`~atbcore.graph.ir.Graph`
(e.g. from ``GraphBuilder``) is accepted too; its weights become parameters under
their graph ids (``q_proj.weight`` ...). Everything else is the core ``GraphOp``
(fusion, plans, plugins, ``explain()``, ``save``/``load``), rebuilt whenever a
parameter changes (see :mod:`.params`).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import paddle

from atbcore.errors import ParamsError
from atbcore.graph.graph_op import GraphOp as CoreGraphOp
from atbcore.graph.ir import Graph
from atbcore.graph.layers import Layer as CoreLayer

from .base import AtbLayer, OpLayer
from .block import GraphBlock, LayerBlock
from .fast_call import FastCall
from .params import ParamSet

__all__ = ["GraphOp"]


def _wrap_core(core: CoreLayer) -> AtbLayer:
    from .catalog import wrap_core

    return wrap_core(core)


class GraphOp(paddle.nn.Layer):
    """A fused, planned block of atb layers (or a core graph) as a Paddle layer.

    ``GraphOp(layers_or_graph, name=None, fusion_config=None, backend=None, **options)``
    with the core GraphOp's options (``dim_names``, ``dynamic_shape``, ``profile``,
    ...). Call it like the core GraphOp: ``y = block(x)``, ``y, kv = block(x,
    kv_cache=kv)``; outputs are Paddle tensors."""

    def __init__(self, layers_or_graph: Sequence[Any] | Graph, name: str | None = None,
                 fusion_config: Any = None, backend: str | None = None, **options: Any) -> None:
        super().__init__()
        self.params = ParamSet(self)
        self._fast: FastCall | None = None  # the last plain call, guarded (fast_call.py)
        if isinstance(layers_or_graph, Graph):
            self._block = GraphBlock(layers_or_graph, self, name, fusion_config, backend, **options)
            return
        if not isinstance(layers_or_graph, (list, tuple)) or not layers_or_graph:
            raise ParamsError(name or "GraphOp", "layers_or_graph",
                              "a non-empty list of atb layers or a Graph", repr(layers_or_graph)[:80])
        cores, owners = [], []
        for i, item in enumerate(layers_or_graph):
            if isinstance(item, CoreLayer):
                item = _wrap_core(item)
            if isinstance(item, AtbLayer):
                cores.append(item.core)
                owners.append(item)
                key = item.core.name or str(i)
            elif isinstance(item, OpLayer):
                cores.append(item.as_core())
                key = item.node_name or str(i)
            else:
                raise ParamsError(name or "GraphOp", f"layer {i}", "an atb_paddle layer "
                                  "(atb.Linear, atb.LayerNorm, ...)", type(item).__name__)
            self.add_sublayer(key.replace(".", "_"), item)
        self._block = LayerBlock(cores, owners, name, fusion_config, backend, **options)

    # ------------------------------------------------------------------ running
    @property
    def core(self) -> CoreGraphOp | None:
        """The core GraphOp of the current weights (None before the first call)."""
        return self._block.op

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        fast = self._fast
        if fast is not None and not kwargs:
            outs = fast(inputs)
            if outs is not None:
                return outs[0] if len(outs) == 1 else tuple(outs)
        with paddle.no_grad():
            core = self._block.get(inputs)
            out = core(*inputs, **kwargs)
        plain = not kwargs and (core._kv is None or not core._kv.slots)
        fast = FastCall.after(core, inputs, self._block.param_sets()) if plain else None
        if fast is not None or self._fast is not None:
            self._fast = fast
        return out

    def execute(self, inputs: Sequence[Any], outputs: list | None = None) -> list:
        """A list of tensors in, the list of outputs back (``outputs`` filled when given)."""
        with paddle.no_grad():
            return self._block.get(inputs).execute(list(inputs), outputs)

    def infer_shape(self, inputs: Sequence[Any]) -> list:
        """Output descriptors for tensors or TensorDescs (creates weights if needed)."""
        return self._block.get(inputs).infer_shape(list(inputs))

    def refresh_weights(self) -> None:
        """Rebuild from the parameters at the next call, after a write to them that
        atb cannot see (``set_value``, ``set_state_dict`` and in-place ops are seen)."""
        for ps in self._block.param_sets():
            ps.touch()

    # ------------------------------------------------------------------ core features
    def register_plugin(self, point: str, plugin: Any) -> "GraphOp":
        """Run ``plugin`` (an ``atb.Plugin``) at ``point`` (``pre_attention``, ...)."""
        self._block.register_plugin(point, plugin)
        self._fast = None
        return self

    def set_dynamic_shape(self, ranges: Mapping[str, Any]) -> None:
        """Declare dynamic dimension ranges (see the core GraphOp)."""
        self._block.set_dynamic_shape(ranges)
        self._fast = None

    def _core_for(self, inputs: Sequence[Any]) -> CoreGraphOp:
        if inputs:
            return self._block.get(inputs)
        if self._block.op is None:
            raise ParamsError(self._block.name or "GraphOp", "GraphOp not built yet",
                              "a first call (or inputs given here)", "no call")
        return self._block.op

    def explain(self, *inputs: Any) -> str:
        """The core GraphOp's explanation (nodes, fusions, kernels, launches, memory)."""
        return self._core_for(inputs).explain(*inputs)

    def to_dot(self, which: str = "after") -> str:
        return self._core_for(()).to_dot(which)

    def to_mermaid(self, which: str = "after") -> str:
        return self._core_for(()).to_mermaid(which)

    @property
    def last_launches(self) -> int | None:
        return None if self._block.op is None else self._block.op.last_launches

    @property
    def memory_plan(self) -> Any:
        return None if self._block.op is None else self._block.op.memory_plan

    def save(self, directory: str | os.PathLike) -> str:
        """The core GraphOp's save (graph JSON + safetensors weights, settings)."""
        return self._core_for(()).save(directory)

    @classmethod
    def load(cls, directory: str | os.PathLike, **overrides: Any) -> "GraphOp":
        """A Paddle GraphOp from a saved directory (weights become parameters)."""
        core = CoreGraphOp.load(directory, **overrides)
        return cls(core.graph_unfused, name=core.name, fusion_config=core.fusion_config,
                   backend=core.backend, dim_names=core.dim_names,
                   dynamic_shape=core._dynamic or None, num_streams=core.num_streams,
                   arena=core.arena)

    def destroy(self) -> None:
        """Free the core GraphOp's plans; the next call builds a new one."""
        self._block.destroy()
        self._fast = None

    def __enter__(self) -> "GraphOp":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()
