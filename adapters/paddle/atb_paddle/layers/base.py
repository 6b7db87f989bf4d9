"""The two kinds of atb Paddle layers.

* :class:`AtbLayer` wraps a core seed-style layer (``LayerNorm(eps=...)``,
  ``Linear(out_features=...)``, ``FlashAttention(num_heads=...)``, ...): it owns
  its weights as Paddle parameters, created at the first call when the input shape
  is known (or when it first runs inside a ``GraphOp``), and called alone it runs
  as a one-layer block. ``state_dict`` keys are the core weight names.
* :class:`OpLayer` is any core op with its params fixed, called on all its input
  tensors (``MatMul(transpose_b=True)(a, b)``, ``Softmax()(x)``); it has no weights.
  A single-input, single-output OpLayer can also stand in a ``GraphOp`` list.

Both run under ``paddle.no_grad()``: atb is an inference library, and its kernels
do not record Paddle autograd history.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import paddle

from atbcore.errors import ParamsError
from atbcore.graph.layers import Layer as CoreLayer
from atbcore.operation import Builder, Operation
from atbcore.ops.registry import get_op

from .block import LayerBlock
from .params import ParamSet

__all__ = ["AtbLayer", "OpLayer", "OpNode", "unpack"]


def unpack(outs: Sequence[Any]) -> Any:
    """One output as itself, several as a tuple (as Paddle layers return them)."""
    return outs[0] if len(outs) == 1 else tuple(outs)


class AtbLayer(paddle.nn.Layer):
    """A core seed-style layer as a Paddle layer with Paddle parameters.

    Subclasses set ``CORE`` (the core layer class); the constructor takes the core
    layer's arguments (an optional leading name, then keywords). ``layer.core`` is
    the core layer, ``layer.params`` its :class:`~.params.ParamSet`."""

    CORE: ClassVar[type[CoreLayer]] = CoreLayer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.core = self.CORE(*args, **kwargs)
        self.params = ParamSet(self)
        self._block: LayerBlock | None = None

    @classmethod
    def wrap(cls, core: CoreLayer) -> "AtbLayer":
        """An AtbLayer around an existing core layer (its weights become parameters)."""
        self = cls.__new__(cls)
        paddle.nn.Layer.__init__(self)
        self.core = core
        self.params = ParamSet(self)
        self._block = None
        if core.weights():
            self.params.adopt(core.weights())
            self.push()
        return self

    def push(self) -> None:
        """Hand the current parameters to the core layer (zero-copy views)."""
        ws = self.params.as_dict()
        if ws:
            self.core.load_weights({n: p.detach() for n, p in ws.items()})

    def extra_repr(self) -> str:
        return repr(self.core)

    def block(self, inputs: Sequence[Any]) -> Any:
        """The core GraphOp running this layer alone (built for these inputs)."""
        if self._block is None:
            self._block = LayerBlock([self.core], [self], self.core.name or self.core.kind)
        return self._block.get(inputs)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run this layer alone (a one-layer block); see :mod:`atbcore.graph.layers`."""
        with paddle.no_grad():
            return self.block(inputs)(*inputs, **kwargs)

    def execute(self, inputs: Sequence[Any], outputs: list | None = None) -> list:
        """Seed style: a list of tensors in, the list of outputs back (``outputs``
        filled when given)."""
        with paddle.no_grad():
            return self.block(inputs).execute(list(inputs), outputs)


class OpNode(CoreLayer):
    """A core layer lowering to one node of ``op`` over the running tensor (how an
    :class:`OpLayer` stands in a ``GraphOp`` list)."""

    def __init__(self, op: str, params: dict[str, Any], name: str | None = None) -> None:
        super().__init__(name)
        self.op, self.op_params = op, dict(params)
        self.kind = op.lower()

    def lower(self, ctx: Any, x: str) -> str:
        opdef = get_op(self.op)
        n_out = opdef.num_outputs(opdef.make_params(self.op_params), {})
        if len(opdef.required_inputs) > 1 or n_out != 1:
            raise ParamsError(ctx.name_of(self), f"{self.op} in a sequential block",
                              "an op of one input and one output", f"inputs {opdef.inputs}, "
                              f"{n_out} outputs")
        return ctx.builder.add_node(self.op, [x], self.op_params, name=ctx.name_of(self))[0]


class OpLayer(paddle.nn.Layer):
    """One core op with fixed params, as a Paddle layer: ``forward(*tensors)``.

    ``OpLayer("MatMul", transpose_b=True)`` or a subclass with ``OP`` set
    (``atb_paddle.ops.MatMul(transpose_b=True)``); ``backend=`` forces a backend.
    Returns one tensor, or a tuple for several outputs."""

    OP: ClassVar[str] = ""

    def __init__(self, *args: Any, backend: str | None = None, name: str | None = None,
                 **params: Any) -> None:
        super().__init__()
        op = self.OP
        if not op:
            if not args:
                raise ParamsError("OpLayer", "op name", "OpLayer('OpName', **params)", "none")
            op, args = args[0], args[1:]
        if args:
            raise ParamsError(op, "positional arguments", "keyword params only", list(args))
        self.operation: Operation = Builder(backend=backend).build_operation(op, params)
        self.op_name = self.operation.name
        self.node_name = name
        self._given = dict(params)

    def extra_repr(self) -> str:
        return f"{self.op_name}, {self._given}"

    def forward(self, *inputs: Any) -> Any:
        with paddle.no_grad():
            return unpack(self.operation.execute(list(inputs)))

    def execute(self, inputs: Sequence[Any], outputs: list | None = None) -> list:
        """The core ``Operation.execute``: a list in, a list out (``outputs`` filled)."""
        with paddle.no_grad():
            return self.operation.execute(inputs, outputs)

    def infer_shape(self, inputs: Sequence[Any]) -> list:
        """Output descriptors for tensors or :class:`~atbcore.TensorDesc` inputs."""
        return self.operation.infer_shape(inputs)

    def as_core(self) -> OpNode:
        """This op as a node of a sequential block."""
        return OpNode(self.op_name, self._given, self.node_name)
