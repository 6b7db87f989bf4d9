"""The base of every atb MindSpore Cell: PyNative through the core, GRAPH_MODE
through pyfunc custom ops.

``AtbCell.__call__`` marks the Cell as running eagerly while MindSpore is in
PyNative mode; ``construct`` then calls :meth:`AtbCell.forward` (plain Python: the
core op or GraphOp, tensors crossing by DLPack without copies). When MindSpore
compiles ``construct`` instead (GRAPH_MODE, or ``mindspore.jit`` around a caller),
``__call__`` does not run as Python, the mark reads ``False`` at compile time and
only the custom-op branch is compiled (:mod:`.graph_mode`). MindSpore's own Cell
machinery (``register_forward_pre_hook`` / ``register_forward_hook``, sub-cells,
parameters) works as for any Cell.
"""

from __future__ import annotations

from typing import Any, Sequence

from atbcore.tensor import TensorDesc, describe, is_tensor

from .._env import mindspore
from .graph_mode import MAX_INPUTS, CustomCall

__all__ = ["AtbCell", "unpack", "in_pynative"]

_nn = mindspore().nn


def unpack(outs: Sequence[Any]) -> Any:
    """One output as itself, several as a tuple (as MindSpore Cells return them)."""
    return outs[0] if len(outs) == 1 else tuple(outs)


def _mode_reader() -> Any:
    """``() -> mode``: MindSpore's own cheap read of the execution mode (what its Cell
    calls per call), else ``get_context("mode")`` (which costs ~14 µs a call)."""
    ms = mindspore()
    read = getattr(ms.context, "_get_mode", None)
    return read if callable(read) else (lambda: ms.get_context("mode"))


_MODE = _mode_reader()
_PYNATIVE = mindspore().PYNATIVE_MODE


def in_pynative() -> bool:
    return _MODE() == _PYNATIVE


class AtbCell(_nn.Cell):
    """Base class; subclasses implement :meth:`forward`, :meth:`run_graph` and
    :meth:`infer` (see :class:`~.graph_mode.CustomCall`)."""

    def __init__(self, name: str, *, min_inputs: int = 1, max_inputs: int = MAX_INPUTS) -> None:
        super().__init__()
        self._atb_eager = False
        self._atb_name = name
        self._atb_custom = CustomCall(name, self.run_graph, self.infer, min_inputs, max_inputs,
                                      roles=self.input_role)
        for n in range(1, MAX_INPUTS + 1):
            # every arity exists as an attribute, so any branch of construct resolves
            prim = self._atb_custom.prims.get(n) or self._atb_custom.prims[
                min(self._atb_custom.prims)]
            setattr(self, f"_atb_p{n}", prim)

    # ------------------------------------------------------------------ subclass API
    def forward(self, *xs: Any) -> Any:
        """PyNative: run on MindSpore tensors, return MindSpore tensors."""
        raise NotImplementedError

    def run_graph(self, tensors: Sequence[Any]) -> list:
        """GRAPH_MODE, inside the pyfunc: run on MindSpore tensors that wrap MindSpore's
        NumPy copies of the inputs; return the outputs (any framework)."""
        raise NotImplementedError

    def infer(self, descs: Sequence[TensorDesc]) -> list[TensorDesc]:
        """Output descriptors for input descriptors (AtbErrors on bad input)."""
        raise NotImplementedError

    def input_role(self, i: int) -> str:
        """``"int"`` or ``"float"``: the dtype guess for input ``i`` under ``mindspore.jit``
        before any call was recorded."""
        return "float"

    def prepare(self, xs: Sequence[Any]) -> None:
        """Called with the real inputs before every PyNative call and before a
        GRAPH_MODE compile (build weights, check inputs)."""

    # ------------------------------------------------------------------ MindSpore
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        descs = [describe(x) for x in args if is_tensor(x)]
        self.prepare(args)
        if in_pynative():
            self._atb_custom.record(descs)
            self._atb_eager = True
            try:
                return super().__call__(*args, **kwargs)
            finally:
                self._atb_eager = False
        self._atb_custom.check(descs)
        return super().__call__(*args, **kwargs)

    def construct(self, *xs):
        if self._atb_eager:
            return self.forward(*xs)
        n = len(xs)
        if n == 1:
            return self._atb_p1(xs[0])
        if n == 2:
            return self._atb_p2(xs[0], xs[1])
        if n == 3:
            return self._atb_p3(xs[0], xs[1], xs[2])
        if n == 4:
            return self._atb_p4(xs[0], xs[1], xs[2], xs[3])
        if n == 5:
            return self._atb_p5(xs[0], xs[1], xs[2], xs[3], xs[4])
        if n == 6:
            return self._atb_p6(xs[0], xs[1], xs[2], xs[3], xs[4], xs[5])
        if n == 7:
            return self._atb_p7(xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6])
        if n == 8:
            return self._atb_p8(xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7])
        if n == 9:
            return self._atb_p9(xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7], xs[8])
        if n == 10:
            return self._atb_p10(xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7], xs[8],
                                 xs[9])
        if n == 11:
            return self._atb_p11(xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7], xs[8],
                                 xs[9], xs[10])
        return self._atb_p12(xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7], xs[8],
                             xs[9], xs[10], xs[11])
