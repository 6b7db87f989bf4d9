"""atb ops and GraphOps as MindSpore custom ops, so they run under GRAPH_MODE.

In GRAPH_MODE (``set_context(mode=GRAPH_MODE)``, ``mindspore.jit``) a Cell's
``construct`` is compiled, not run as Python, so the core cannot be called
directly. Each atb Cell therefore owns ``ops.Custom(func, out_shape, out_dtype,
func_type="pyfunc")`` primitives (one per number of inputs: MindSpore reads the
arity from the function's signature and passes a ``*args`` call as one tuple,
which pyfunc ops refuse). At run time MindSpore calls ``func`` with **NumPy copies**
of the inputs; they are wrapped (without a further copy) as MindSpore tensors and
run through the same core op / GraphOp as PyNative, so both modes use the same
MindSpore kernels, and the outputs are copied back into MindSpore's buffers.
Under ``mindspore.jit`` in PyNative mode a MindSpore op issued from inside the
pyfunc would wait for the graph running it (a deadlock), so there the arrays stay
NumPy and dispatch skips the MindSpore backend (torch, else the NumPy reference).

``out_shape`` receives only shapes and ``out_dtype`` only dtypes; both come from the
core's shape inference. The dtypes ``out_shape`` needs are those of the last call of
the Cell (recorded before every GRAPH_MODE call and every PyNative call), else
guessed from the inputs' roles (int64 ids, fp32 otherwise); ``out_dtype`` uses the
shapes ``out_shape`` just saw. MindSpore's pyfunc kernels take no bf16 tensors and
no zero-size tensors, so both are refused here with a :class:`CapabilityError`
(PyNative runs them).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from atbcore.dtypes import Dtype
from atbcore.errors import CapabilityError
from atbcore.tensor import TensorDesc

from .._env import mindspore

__all__ = ["CustomCall", "MAX_INPUTS", "dtype_of_type"]

MAX_INPUTS = 12

Infer = Callable[[Sequence[TensorDesc]], "list[TensorDesc]"]
Run = Callable[[Sequence[Any]], "list[Any]"]


def _fixed_arity(n: int, impl: Callable[..., Any]) -> Callable[..., Any]:
    """``impl`` behind a function of exactly ``n`` positional parameters (with source:
    ``ops.Custom`` reads both the signature and the source of ``func``)."""
    if n == 1:
        def f(a0):
            return impl(a0)
    elif n == 2:
        def f(a0, a1):
            return impl(a0, a1)
    elif n == 3:
        def f(a0, a1, a2):
            return impl(a0, a1, a2)
    elif n == 4:
        def f(a0, a1, a2, a3):
            return impl(a0, a1, a2, a3)
    elif n == 5:
        def f(a0, a1, a2, a3, a4):
            return impl(a0, a1, a2, a3, a4)
    elif n == 6:
        def f(a0, a1, a2, a3, a4, a5):
            return impl(a0, a1, a2, a3, a4, a5)
    elif n == 7:
        def f(a0, a1, a2, a3, a4, a5, a6):
            return impl(a0, a1, a2, a3, a4, a5, a6)
    elif n == 8:
        def f(a0, a1, a2, a3, a4, a5, a6, a7):
            return impl(a0, a1, a2, a3, a4, a5, a6, a7)
    elif n == 9:
        def f(a0, a1, a2, a3, a4, a5, a6, a7, a8):
            return impl(a0, a1, a2, a3, a4, a5, a6, a7, a8)
    elif n == 10:
        def f(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9):
            return impl(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9)
    elif n == 11:
        def f(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10):
            return impl(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10)
    elif n == 12:
        def f(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11):
            return impl(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11)
    else:
        raise ValueError(n)
    return f


def dtype_of_type(t: Any) -> Dtype:
    """atb's Dtype of what ``out_dtype`` receives (``mindspore.tensor[float32]``)."""
    elem = t.element_type() if hasattr(t, "element_type") else t
    return Dtype.of(str(elem))


class CustomCall:
    """The pyfunc primitives of one Cell and their shape/dtype inference.

    ``run(tensors)`` computes the outputs (MindSpore tensors wrapping the pyfunc's
    NumPy inputs); ``infer(descs)`` gives
    their descriptors (raising AtbErrors for bad input); ``roles`` guesses an input's
    dtype by position when no call was recorded yet (``"int"`` or ``"float"``)."""

    def __init__(self, name: str, run: Run, infer: Infer, min_inputs: int = 1,
                 max_inputs: int = MAX_INPUTS, roles: Callable[[int], str] | None = None) -> None:
        self.name = name
        self._run_fn, self._infer = run, infer
        self._roles = roles or (lambda i: "float")
        self.recorded: list[TensorDesc] | None = None
        self._last_shapes: tuple | None = None
        self.min_inputs, self.max_inputs = max(1, min_inputs), min(max_inputs, MAX_INPUTS)
        ops = mindspore().ops
        self.prims = {n: ops.Custom(_fixed_arity(n, self._run), out_shape=self._out_shape,
                                    out_dtype=self._out_dtype, func_type="pyfunc")
                      for n in range(self.min_inputs, self.max_inputs + 1)}

    # ------------------------------------------------------------------ recording
    def record(self, descs: Sequence[TensorDesc]) -> None:
        """The descriptors of the Cell's latest call (used by ``out_shape``)."""
        self.recorded = list(descs)

    def check(self, descs: Sequence[TensorDesc]) -> list[TensorDesc]:
        """Validate a GRAPH_MODE call before MindSpore compiles it: AtbErrors surface
        as themselves instead of wrapped in MindSpore's compile errors."""
        n = len(descs)
        if not self.min_inputs <= n <= self.max_inputs:
            raise CapabilityError(self.name, "number of inputs in GRAPH_MODE",
                                  f"{self.min_inputs} to {self.max_inputs}", n)
        if any(d.numel == 0 for d in descs):
            raise CapabilityError(self.name, "an empty tensor in GRAPH_MODE (MindSpore pyfunc "
                                  "custom ops cannot copy zero-size inputs)",
                                  "non-empty inputs (an empty KV-cache past: PyNative)",
                                  [list(d.shape) for d in descs])
        if any(d.dtype == Dtype.BF16 for d in descs):
            raise CapabilityError(self.name, "bf16 in GRAPH_MODE (MindSpore pyfunc custom ops "
                                  "take no bf16 tensors)", "fp32/fp16, or PyNative mode for bf16",
                                  "a bf16 input")
        self.record(descs)
        return self._infer(descs)

    # ------------------------------------------------------------------ MindSpore hooks
    def _dtypes_for(self, n: int) -> list[Dtype]:
        if self.recorded is not None and len(self.recorded) == n:
            return [d.dtype for d in self.recorded]
        return [Dtype.INT64 if self._roles(i) == "int" else Dtype.FP32 for i in range(n)]

    def _out_shape(self, *shapes: Any) -> Any:
        shapes = tuple(tuple(int(s) for s in sh) for sh in shapes)
        self._last_shapes = shapes
        outs = self._infer([TensorDesc(s, d) for s, d in zip(shapes, self._dtypes_for(len(shapes)))])
        got = [list(o.shape) for o in outs]
        return got[0] if len(got) == 1 else tuple(got)

    def _out_dtype(self, *types: Any) -> Any:
        dts = [dtype_of_type(t) for t in types]
        if Dtype.BF16 in dts:
            raise CapabilityError(self.name, "bf16 in GRAPH_MODE", "fp32/fp16", "bf16")
        shapes = self._last_shapes
        if shapes is None or len(shapes) != len(dts):
            shapes = tuple(d.shape for d in (self.recorded or ()))
        outs = self._infer([TensorDesc(s, d) for s, d in zip(shapes, dts)])
        from ..bridge import ms_dtype

        got = [ms_dtype(o.dtype) for o in outs]
        return got[0] if len(got) == 1 else tuple(got)

    def _run(self, *arrays: np.ndarray) -> Any:
        from atbcore.tensor import from_numpy, to_numpy

        ms = mindspore()
        if ms.get_context("mode") == ms.PYNATIVE_MODE:
            # mindspore.jit under PyNative: a MindSpore op issued from here would wait
            # for the very graph that runs this pyfunc. NumPy in, other backends only.
            from ..backend import blocked

            with blocked("no MindSpore ops inside a pyfunc under mindspore.jit (PyNative)"):
                outs = self._run_fn(list(arrays))
        else:
            outs = self._run_fn([from_numpy(a, "mindspore") for a in arrays])
        outs = [np.ascontiguousarray(to_numpy(o)) for o in outs]
        return outs[0] if len(outs) == 1 else tuple(outs)
