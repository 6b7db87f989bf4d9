"""The guarded fast call of an ``atb_paddle.GraphOp``: its last plain call again.

The general path rebuilds the core GraphOp's weight signature from every parameter
(names looked up, dtypes as strings), converts nothing, then asks the core for the
plan by the inputs' raw signature. After such a call the layer keeps a
:class:`FastCall`: the inputs' type, shape, dtype and place, and per parameter the
dict that holds it, the object, its address, inplace version and dtype, plus each
:class:`~.params.ParamSet`'s generation (``set_value``, ``refresh_weights``). A call
that matches them all runs the core's remembered program
(:class:`~atbcore.graph.graph_op_hot.RememberedCall`); anything else returns None and
takes the general path, which checks everything (and raises the usual AtbError).
"""

from __future__ import annotations

from typing import Any, Sequence

import paddle

from atbcore.graph.graph_op_hot import RememberedCall

from .params import ParamSet, _key

__all__ = ["FastCall"]


def _place_of(dotted: str) -> tuple[tuple[str, ...], str]:
    """The sublayer keys and parameter key of weight ``a.b.weight`` (see params.py)."""
    *path, last = dotted.split(".")
    return tuple(_key(p) for p in path), _key(last)


class FastCall:
    """See the module doc; ``fast(inputs)`` is the outputs or None."""

    __slots__ = ("program", "sig", "sets", "checks")

    def __init__(self, program: RememberedCall, inputs: Sequence[Any],
                 sets: Sequence[ParamSet]) -> None:
        self.program = program
        self.sig = tuple((type(x), x.shape, x.dtype, x.place) for x in inputs)
        self.sets = tuple((ps, ps.generation, len(ps.names)) for ps in sets)
        checks = []
        for ps in sets:
            owner = ps._owner()
            for name, p in ps:
                path, last = _place_of(name)
                checks.append((owner, path, last, p, p.data_ptr(), p._inplace_version(),
                               p.dtype))
        self.checks = tuple(checks)

    @classmethod
    def after(cls, core: Any, inputs: Sequence[Any], sets: Sequence[ParamSet]
              ) -> "FastCall | None":
        """The fast call of the plain call just made on ``core`` (None: not one that
        can be repeated this way)."""
        if not inputs or any(type(x) is not paddle.Tensor for x in inputs):
            return None
        program = RememberedCall.of(core, list(inputs))
        return None if program is None else cls(program, inputs, sets)

    def __call__(self, inputs: Sequence[Any]) -> list | None:
        if len(inputs) != len(self.sig):
            return None
        for x, (kind, shape, dtype, place) in zip(inputs, self.sig):
            if (type(x) is not kind or x.shape != shape or x.dtype != dtype
                    or not x.place._equals(place)):
                return None
        for ps, generation, n in self.sets:
            if ps.generation != generation or len(ps.names) != n:
                return None
        for owner, path, last, p, address, version, dtype in self.checks:
            layer = owner
            for k in path:
                layer = layer._sub_layers.get(k)
                if layer is None:
                    return None
            if (layer._parameters.get(last) is not p or p.data_ptr() != address
                    or p._inplace_version() != version or p.dtype != dtype):
                return None
        return self.program.run(list(inputs))
