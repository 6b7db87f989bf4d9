"""Every core op as a MindSpore Cell called on all its tensors (no weights of its own):

    import atb_mindspore as atb
    attn = atb.ops.FlashAttention(num_heads=32, num_kv_heads=8, causal=True)
    out = attn(q, k, v)                        # mindspore tensors in and out
    y, s = atb.ops.AddRmsNorm(eps=1e-6)(x, residual, weight)

PyNative runs the core :class:`~atbcore.operation.Operation` (MindSpore tensors go
to the MindSpore backend first); GRAPH_MODE runs the same Operation inside a pyfunc
custom op. Optional inputs in the middle of the list take ``None`` in PyNative;
GRAPH_MODE passes tensors only (an op binds them by position and kind as usual).
"""

from __future__ import annotations

from typing import Any, Sequence

from atbcore.operation import Builder, Operation
from atbcore.ops.registry import all_ops, get_op

from .base import AtbCell, unpack
from .graph_mode import MAX_INPUTS

__all__ = ["OpCell", "op_cell_class", "OP_CELLS"]

_INT_INPUTS = frozenset({"position_ids", "seq_lens", "ids", "indices", "slot_mapping",
                         "block_tables", "context_lens", "q_seq_lens"})


class OpCell(AtbCell):
    """A core op with fixed params as a Cell: ``OpCell("Softmax", dim=-1)(x)``.

    ``params`` / keywords are the op's params (seed aliases accepted); ``backend``
    forces a backend (default: MindSpore's own kernels first, then by priority)."""

    op_name: str = ""

    def __init__(self, op: str | None = None, params: dict | None = None, *,
                 backend: str | None = None, **kw: Any) -> None:
        opdef = get_op(op or self.op_name)
        self.operation: Operation = Builder(backend=backend).build_operation(
            opdef.name, {**(params or {}), **kw})
        n_in = len(opdef.inputs) if opdef.name != "Concat" else MAX_INPUTS
        super().__init__(opdef.name, min_inputs=len(opdef.required_inputs) or 1,
                         max_inputs=min(n_in, MAX_INPUTS))

    @property
    def params(self) -> Any:
        """The op's frozen params."""
        return self.operation.params

    def extend_repr(self) -> str:
        return repr(self.operation.params)

    def forward(self, *xs: Any) -> Any:
        return unpack(self.operation.execute(list(xs)))

    def run_graph(self, arrays: Sequence[Any]) -> list:
        return self.operation.execute(list(arrays))

    def infer(self, descs):
        return self.operation.infer_shape(list(descs))

    def input_role(self, i: int) -> str:
        names = self.operation.opdef.input_names
        return "int" if i < len(names) and names[i] in _INT_INPUTS else "float"

    def infer_shape(self, inputs: Sequence[Any]) -> Any:
        """Output descriptors for tensors or :class:`TensorDesc` inputs."""
        return self.operation.infer_shape(list(inputs))


_CLASSES: dict[str, type] = {}


def op_cell_class(name: str) -> type:
    """The OpCell subclass named after core op ``name`` (created once)."""
    opdef = get_op(name)
    cls = _CLASSES.get(opdef.name)
    if cls is None:
        doc = (f"The core op ``{opdef.name}`` as a MindSpore Cell; keywords are its params "
               f"({opdef.Params.__name__}). Inputs: {', '.join(opdef.inputs)}.")
        cls = type(opdef.name, (OpCell,), {"op_name": opdef.name, "__doc__": doc,
                                           "__module__": "atb_mindspore.ops"})
        _CLASSES[opdef.name] = cls
    return cls


def _all() -> dict[str, type]:
    out = {name: op_cell_class(name) for name in all_ops()}
    for name, opdef in all_ops().items():
        for alias in opdef.aliases:
            if alias.isidentifier():
                out.setdefault(alias, out[name])
    return out


OP_CELLS: dict[str, type] = _all()
