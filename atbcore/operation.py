"""``Operation`` (one op bound to its params) and ``Builder`` (builds ops by name).

    op = Builder().build_operation("RmsNorm", {"eps": 1e-6})
    y, = op.execute([x, weight])          # any framework's tensors
    op.execute([x, weight], [out])        # writes into ``out``
"""

from __future__ import annotations

import functools
import math
import os
import sys
from typing import Any, Mapping, Sequence

import numpy as np

from .backends import select_backend
from .errors import AtbError, DeviceError, DtypeError, InputError, ParamsError, ShapeError
from .ops.base import OpDef, Params
from .ops.registry import get_op
from .tensor import TensorDesc, convert, copy_into, describe, framework_of, is_tensor

# op names the tensor helpers use when they do not know which op called them
_ANONYMOUS = frozenset({"tensor", "TensorDesc"})

__all__ = ["Operation", "Builder", "destroy_operations", "check_writable", "check_output_sizes"]


class Operation:
    """An op with fixed params, ready to run on tensors of any supported framework.

    ``execute(inputs, outputs=None)`` returns the list of outputs in the framework
    of the first input. When ``outputs`` is given, results are written into those
    tensors and :class:`TensorDesc` placeholders in the list are replaced by the
    results. Every given output is checked first (shape, dtype, writable: not a
    read-only array, not a meta or self-overlapping tensor) and every result is
    computed before the first is written, so a failed call writes nothing. Each
    failure a caller can cause, a kernel's own included, is an :class:`AtbError`
    naming this op.
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
        try:
            return self._execute(inputs, outputs)
        except AtbError as e:
            if e.op in _ANONYMOUS:  # raised by a tensor helper that does not know the op
                raise type(e)(self.name, e.what, e.expected, e.given) from None
            raise

    def _execute(self, inputs: Sequence[Any], outputs: list | None) -> list:
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
        out_descs = self._infer(descs)
        if self.dynamic_shape:
            self._check_dynamic(descs)
        check_output_sizes(self.name, out_descs)
        if outputs is not None:
            self._check_outputs(outputs, out_descs)
        framework = next(framework_of(x) for x in inputs if x is not None)
        backend, skipped = select_backend(self.opdef, self.params, descs, self.backend, framework)
        self.last_backend, self.last_fallbacks = backend.name, skipped

        names = self.opdef.input_names
        native = {n: None for n in names}
        bound = self.opdef.bind(self.params, inputs)
        for in_idx in self.opdef.inplace.values():  # caches the op writes in place
            x = bound.get(names[in_idx])
            if x is not None:
                what = f"input {names[in_idx]!r} (written in place)"
                check_writable(self.name, what, x)
                if isinstance(x, np.ndarray) and backend.native != "numpy" \
                        and any(st < 0 for st in x.strides):
                    raise InputError(self.name, f"{what} has negative strides",
                                     "an array the kernel can write through (no negative strides)",
                                     f"strides {list(x.strides)}")
        for n, x in bound.items():
            native[n] = None if x is None else convert(x, backend.native)
        self.opdef.check_values(self.params, native)
        results = self._run(backend, native, out_descs)
        if len(results) != len(out_descs):
            raise AtbError(self.name, f"{backend.name} kernel returned {len(results)} outputs",
                           len(out_descs), len(results))

        if outputs is None:
            return [convert(r, framework) for r in results]
        # every result exists and every slot was checked: the writes below cannot fail
        # half-way for a reason the user caused
        for i, (slot, r) in enumerate(zip(outputs, results)):
            if isinstance(slot, TensorDesc) or slot is None:
                outputs[i] = convert(r, framework)
            else:
                # a NumPy slot is written by NumPy: a torch view of a negative-stride
                # array would be a copy, and the values would never reach the caller
                copy_into(slot, r, "numpy" if isinstance(slot, np.ndarray) else backend.native)
        return outputs

    def _infer(self, descs: Mapping[str, TensorDesc | None]) -> list[TensorDesc]:
        try:
            return self.opdef.infer_shape(self.params, descs)
        except AtbError:
            raise
        except (IndexError, KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            # an op's shape rules indexing a dim the input lacks (a 0-d tensor ...)
            shapes = {n: list(d.shape) for n, d in descs.items() if d is not None}
            raise ShapeError(self.name, "input shapes", "shapes the op accepts",
                             f"{shapes} ({type(e).__name__}: {e})") from None

    def _run(self, backend: Any, native: dict[str, Any], out_descs: list[TensorDesc]) -> list:
        """The kernel's results; a kernel that fails becomes an AtbError naming the op."""
        if out_descs and all(-1 not in d.shape and math.prod(d.shape) == 0 for d in out_descs) \
                and not self.opdef.inplace:
            # nothing to compute: empty results without asking a kernel that may not
            # take zero rows
            return [empty_like_desc(d, backend.native, native) for d in out_descs]
        try:
            return backend.run(self.opdef, self.params, native)
        except AtbError as e:
            if e.op != self.name:  # a kernel helper's own check: say which op the user ran
                raise type(e)(self.name, f"{e.op}: {e.what}", e.expected, e.given) from e
            raise
        except MemoryError as e:
            raise AtbError(self.name, f"{backend.name} kernel ran out of memory",
                           "inputs that fit in memory", str(e)) from e
        except (RuntimeError, ValueError, TypeError, IndexError, ZeroDivisionError,
                OverflowError, AttributeError) as e:
            raise AtbError(self.name, f"{backend.name} kernel failed",
                           "inputs the kernel accepts", f"{type(e).__name__}: {e}") from e
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
            if slot is None or isinstance(slot, TensorDesc):
                continue
            oname = self.opdef.outputs[i] if i < len(self.opdef.outputs) else str(i)
            if not is_tensor(slot):
                raise InputError(self.name, f"output {oname!r} type", "a tensor, TensorDesc or None",
                                 type(slot).__name__)
            got = describe(slot)
            if -1 not in want.shape and tuple(got.shape) != tuple(want.shape):
                raise ShapeError(self.name, f"output {oname!r} shape", list(want.shape),
                                 list(got.shape))
            if got.dtype != want.dtype:
                raise DtypeError(self.name, f"output {oname!r} dtype", want.dtype.name,
                                 got.dtype.name)
            check_writable(self.name, f"output {oname!r}", slot)

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


# ----------------------------------------------------------------------------- output checks


@functools.cache
def _memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def check_output_sizes(op: str, descs: Sequence[TensorDesc]) -> None:
    """Refuse a call whose outputs could never fit in this machine's memory, before
    anything is allocated (a huge ``max_seq_len`` asks for terabytes otherwise)."""
    # math.prod, not TensorDesc.nbytes (np.prod): this runs on every call
    total = sum(math.prod(d.shape) * d.dtype.itemsize for d in descs if -1 not in d.shape)
    limit = _memory_bytes()
    if total > limit:
        shapes = [list(d.shape) for d in descs]
        raise ShapeError(op, "output size", f"at most {limit} bytes (this machine's memory)",
                         f"{total} bytes for outputs {shapes}")


def check_writable(op: str, what: str, t: Any) -> None:
    """Raise unless results can be copied into ``t``: a read-only NumPy array, a
    meta tensor, an expanded (self-overlapping) tensor, an inference tensor outside
    inference mode or a leaf that requires grad would otherwise fail half-way
    through the writes, or silently keep its old values."""
    if isinstance(t, np.ndarray):
        if not t.flags.writeable:
            raise InputError(op, f"{what} is read-only", "a writeable array",
                             "an array with flags.writeable = False")
        return
    torch = sys.modules.get("torch")  # a torch tensor implies torch is imported
    if torch is None or not isinstance(t, torch.Tensor):
        return
    if t.device.type == "meta":
        raise DeviceError(op, f"{what} device", "a device with memory (cpu, cuda, ...)",
                          "meta (a tensor without data)")
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        raise InputError(op, f"{what} overlaps itself", "a tensor whose elements are distinct",
                         f"strides {list(t.stride())} for shape {list(t.shape)}")
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise InputError(op, f"{what} is an inference tensor", "a tensor writable outside "
                         "torch.inference_mode()", "an inference tensor")
    if t.requires_grad and t.is_leaf and torch.is_grad_enabled():
        raise InputError(op, f"{what} requires grad", "a tensor autograd lets us write "
                         "(detach() it, or call under torch.no_grad())", "a leaf with requires_grad")


def empty_like_desc(d: TensorDesc, native: str, ins: Mapping[str, Any]) -> Any:
    """An empty result of ``d`` as a ``native`` tensor, on the inputs' device."""
    if native == "numpy":
        return np.empty(d.shape, d.dtype.numpy)
    import torch

    dev = next((x.device for x in ins.values() if isinstance(x, torch.Tensor)), "cpu")
    return torch.empty(d.shape, dtype=d.dtype.torch, device=dev)
