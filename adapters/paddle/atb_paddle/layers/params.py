"""Paddle parameters for atb weights, kept in step with the graphs that read them.

The Paddle parameters are the weights: ``state_dict()`` lists them under the core
layers' weight names (``weight``, ``bias``, ``q_proj.weight`` ...; a dotted name
nests a holder sublayer) and ``set_state_dict`` / ``save`` / ``load`` work as for
any Paddle layer. The graphs read them without a copy (DLPack views of the
parameters' memory), so in-place updates are seen as they happen.

Some graph weights are derived, though (a cast to the input dtype, a fusion pass
that concatenates q/k/v weights), so every change to a parameter has to be noticed
and the graph rebuilt. A :class:`ParamSet` notices:

* ``set_value`` (what ``set_state_dict`` and ``paddle.load`` paths call, keeping the
  same memory): each parameter's own ``set_value`` is wrapped to bump a counter;
* in-place ops (``add_``, item writes): Paddle's inplace version counter;
* a parameter replaced or re-allocated (``layer.to(dtype=...)``): its identity and
  data pointer.

A write that none of these sees (``paddle.assign(v, output=p)``) is picked up by
:meth:`ParamSet.touch` (``GraphOp.refresh_weights()``).
"""

from __future__ import annotations

import weakref
from typing import Any, Iterator, Mapping

import numpy as np
import paddle

from atbcore.dtypes import Dtype

__all__ = ["ParamSet", "set_param", "get_param"]


class _Holder(paddle.nn.Layer):
    """Holds the parameters under one prefix of dotted weight names."""

    def forward(self, *args: Any) -> Any:  # pragma: no cover - a container only
        raise TypeError("a parameter holder is not callable")


def _key(name: str) -> str:
    # Paddle refuses '.' in parameter and sublayer names
    return name.replace(".", "_")


def get_param(layer: paddle.nn.Layer, dotted: str) -> Any:
    """The parameter ``a.b.weight`` under ``layer`` (None when absent)."""
    *path, last = dotted.split(".")
    for p in path:
        layer = layer._sub_layers.get(_key(p))
        if layer is None:
            return None
    return layer._parameters.get(_key(last))


def set_param(layer: paddle.nn.Layer, dotted: str, param: Any) -> None:
    """Register ``param`` as ``a.b.weight`` under ``layer`` (holders created as needed)."""
    *path, last = dotted.split(".")
    for p in path:
        sub = layer._sub_layers.get(_key(p))
        if sub is None:
            sub = _Holder()
            layer.add_sublayer(_key(p), sub)
        layer = sub
    layer.add_parameter(_key(last), param)


def new_param(value: Any) -> Any:
    """A Paddle parameter holding a copy of ``value`` (NumPy array or tensor)."""
    from atbcore.tensor import to_numpy

    a = np.ascontiguousarray(value if isinstance(value, np.ndarray) else to_numpy(value))
    dtype = Dtype.of(a.dtype)
    if dtype == Dtype.BF16:
        t = paddle.to_tensor(a.view(np.int16)).view(paddle.bfloat16)
    else:
        t = paddle.to_tensor(a)
    p = paddle.create_parameter(list(a.shape), dtype=dtype.value,
                                default_initializer=paddle.nn.initializer.Assign(t))
    return p


class ParamSet:
    """The parameters of one owner layer, by weight name, with change tracking."""

    def __init__(self, owner: paddle.nn.Layer) -> None:
        self._owner = weakref.ref(owner)
        self.names: list[str] = []
        self.generation = 0

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        owner = self._owner()
        for n in self.names:
            p = get_param(owner, n) if owner is not None else None
            if p is not None:
                yield n, p

    def get(self, name: str) -> Any:
        owner = self._owner()
        return None if owner is None else get_param(owner, name)

    def adopt(self, weights: Mapping[str, Any]) -> list[str]:
        """Create parameters for weights that have none (or whose shape changed);
        returns the names created."""
        owner = self._owner()
        made = []
        for n, w in weights.items():
            p = get_param(owner, n)
            if p is not None and tuple(p.shape) == tuple(np.shape(w)):
                continue
            p = new_param(w)
            set_param(owner, n, p)
            if n not in self.names:
                self.names.append(n)
            made.append(n)
        return made

    def watch(self) -> None:
        """Wrap ``set_value`` of every parameter not wrapped yet (new or replaced ones)."""
        for _, p in self:
            if not getattr(p, "_atb_watched", False):
                self._watch(p)

    def _watch(self, p: Any) -> None:
        ref = weakref.ref(self)
        orig = p.set_value
        p._atb_watched = True

        def set_value(value: Any, *a: Any, **kw: Any) -> Any:
            me = ref()
            if me is not None:
                me.generation += 1
            return orig(value, *a, **kw)

        p.set_value = set_value

    def touch(self) -> None:
        """Mark the weights changed (after a write the tracking cannot see)."""
        self.generation += 1

    def signature(self) -> tuple:
        """Changes whenever a parameter's value may have changed (see module doc)."""
        return (self.generation,) + tuple(
            (n, id(p), p.data_ptr(), p._inplace_version(), str(p.dtype)) for n, p in self)

    def as_dict(self) -> dict[str, Any]:
        return dict(self)
