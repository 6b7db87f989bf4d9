"""``Operation`` (one op bound to its params) and ``Builder`` (builds ops by name).

    op = Builder().build_operation("RmsNorm", {"eps": 1e-6})
    y, = op.execute([x, weight])          # any framework's tensors
    op.execute([x, weight], [out])        # writes into ``out``
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .backends import select_backend
from .errors import AtbError, DtypeError, InputError, ParamsError, ShapeError
from .ops.base import OpDef, Params
from .ops.registry import get_op
from .tensor import TensorDesc, convert, copy_into, describe, framework_of, is_tensor

__all__ = ["Operation", "Builder", "destroy_operations"]


class Operation:
    """An op with fixed params, ready to run on tensors of any supported framework.

    ``execute(inputs, outputs=None)`` returns the list of outputs in the framework
    of the first input. When ``outputs`` is given, results are written into those
    tensors (shapes and dtypes are checked first; nothing is written on error),
    and :class:`TensorDesc` placeholders in the list are replaced by the results.
    """

    def __init__(self, opdef: OpDef, params: Params, backend: str | None = None,
                 dynamic_shape: Mapping[str, Any] | None = None) -> None:
        self.opdef = opdef
        self.params = params
        self.backend = backend
        self.dynamic_shape = dict(dynamic_shape or {})
        self._ranges: Any = None
        self.last_backend: str | None = None
        self.last_fallbacks: list[tuple[str, list[str]]] = []
        self._destroyed = False

    @property
    def name(self) -> str:
        return self.opdef.name

    def __repr__(self) -> str:
        return f"Operation({self.name}, {self.params})"

    # ------------------------------------------------------------------ shapes
    def _bind_descs(self, inputs: Sequence[Any]) -> dict[str, TensorDesc | None]:
        items = []
        for i, x in enumerate(inputs):
            if x is None:
                items.append(None)
            elif isinstance(x, TensorDesc):
                items.append(x)
            elif is_tensor(x):
                items.append(describe(x))
            else:
                raise InputError(self.name, f"input {i} type", "a tensor or TensorDesc",
                                 type(x).__name__)
        bound = self.opdef.bind(self.params, items)
        for n in self.opdef.required_inputs:
            if bound.get(n) is None:
                raise InputError(self.name, f"input {n!r} is missing", "a tensor", "None")
        return bound

    def infer_shape(self, inputs: Sequence[Any]) -> list[TensorDesc]:
        """Output descriptors for inputs given as tensors or :class:`TensorDesc`."""
        self._check_alive()
        return self.opdef.infer_shape(self.params, self._bind_descs(inputs))

    # ------------------------------------------------------------------ running
    def execute(self, inputs: Sequence[Any], outputs: list | None = None) -> list:
        """Run on real tensors; see the class docstring."""
        self._check_alive()
        if not isinstance(inputs, (list, tuple)):
            # a bare tensor would otherwise be iterated row by row and misread
            raise InputError(self.name, "inputs", "a list or tuple of tensors",
                             type(inputs).__name__)
        if outputs is not None and not isinstance(outputs, list):
            raise InputError(self.name, "outputs", "a list (filled in place)",
                             type(outputs).__name__)
        inputs = list(inputs)
        for i, x in enumerate(inputs):
            if isinstance(x, TensorDesc):
                raise InputError(self.name, f"input {i} has no data", "a tensor",
                                 f"{x!r} (a descriptor; pass the tensor itself)")
        descs = self._bind_descs(inputs)
        out_descs = self.opdef.infer_shape(self.params, descs)
        if self.dynamic_shape:
            self._check_dynamic(descs)
        if outputs is not None:
            self._check_outputs(outputs, out_descs)
        framework = next(framework_of(x) for x in inputs if x is not None)
        backend, skipped = select_backend(self.opdef, self.params, descs, self.backend, framework)
        self.last_backend, self.last_fallbacks = backend.name, skipped

        names = self.opdef.input_names
        native = {n: None for n in names}
        bound = self.opdef.bind(self.params, inputs)
        for n, x in bound.items():
            native[n] = None if x is None else convert(x, backend.native)
        self.opdef.check_values(self.params, native)
        results = backend.run(self.opdef, self.params, native)
        if len(results) != len(out_descs):
            raise AtbError(self.name, f"{backend.name} kernel returned {len(results)} outputs",
                           len(out_descs), len(results))

        if outputs is None:
            return [convert(r, framework) for r in results]
        for i, (slot, r) in enumerate(zip(outputs, results)):
            if isinstance(slot, TensorDesc) or slot is None:
                outputs[i] = convert(r, framework)
            else:
                copy_into(slot, r, backend.native)
        return outputs

    __call__ = execute

    def _check_dynamic(self, descs: Mapping[str, TensorDesc | None]) -> None:
        """Inputs must lie in the ranges declared with ``Builder.set_dynamic_shape``
        (dims named by the convention [batch_size, seq_len, hidden_size])."""
        if self._ranges is None:
            from .runtime.plan_cache import PlanCache

            self._ranges = PlanCache(lambda d, f: None, name=self.name,  # type: ignore[arg-type]
                                     dynamic_shape=self.dynamic_shape)
        self._ranges.check({n: d for n, d in descs.items() if d is not None})

    def _check_outputs(self, outputs: list, out_descs: list[TensorDesc]) -> None:
        # Fewer outputs than the op produces is allowed (the seed's AddLayerNorm passes
        # only the normed value): the leading ones are written, the rest dropped.
        if not 1 <= len(outputs) <= len(out_descs):
            exp = f"1 to {len(out_descs)}" if len(out_descs) > 1 else "1"
            raise InputError(self.name, "number of outputs", exp, len(outputs))
        for i, (slot, want) in enumerate(zip(outputs, out_descs)):
            if slot is None:
                continue
            got = slot if isinstance(slot, TensorDesc) else describe(slot)
            oname = self.opdef.outputs[i] if i < len(self.opdef.outputs) else str(i)
            if -1 not in want.shape and tuple(got.shape) != tuple(want.shape):
                raise ShapeError(self.name, f"output {oname!r} shape", list(want.shape),
                                 list(got.shape))
            if got.dtype != want.dtype:
                raise DtypeError(self.name, f"output {oname!r} dtype", want.dtype.name,
                                 got.dtype.name)

    # ------------------------------------------------------------------ lifetime
    def destroy(self) -> None:
        """Release resources; the op can no longer run."""
        self._destroyed = True

    def _check_alive(self) -> None:
        if self._destroyed:
            raise AtbError(self.name, "operation was destroyed", "a live operation", "destroyed")

    def __enter__(self) -> "Operation":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()


class Builder:
    """Builds operations by name (aliases included) and, later, graphs.

    ``Builder().build_operation("MhaV3", {"head_num": 32, ...})``
    """

    def __init__(self, backend: str | None = None) -> None:
        self.backend = backend
        self.dynamic_shape: dict[str, Any] = {}

    def build_operation(self, op_name: str, params: Mapping[str, Any] | Params | None = None,
                        **kw: Any) -> Operation:
        opdef = get_op(op_name)
        if params is not None and not isinstance(params, (Mapping, Params)):
            raise ParamsError(opdef.name, "params", "a dict of parameters", type(params).__name__)
        return Operation(opdef, opdef.make_params(params, **kw), backend=self.backend,
                         dynamic_shape=self.dynamic_shape)

    def set_dynamic_shape(self, ranges: Mapping[str, Any]) -> None:
        """Declare dimension ranges (``{"batch_size": (1, 64), "seq_len": (1, 8192)}``)
        that operations built afterwards enforce: an input outside raises ShapeError."""
        self.dynamic_shape = dict(ranges)


def destroy_operations(ops: Sequence[Operation]) -> None:
    """Destroy several operations at once."""
    for op in ops:
        op.destroy()
