"""``Block``: a core GraphOp whose weights are MindSpore Parameters.

The Parameters are the weights: ``save_checkpoint`` / ``load_checkpoint`` /
``load_param_into_net`` see them under the Cells' names. The core graph is built
from them (lowering reads NumPy views of the Parameters' memory, no copy) and is
rebuilt whenever a Parameter changes, which a :class:`Block` notices by each
Parameter's identity, data pointer (``set_data``, ``load_param_into_net`` and
``load_checkpoint`` all give new memory) and version counter (where MindSpore bumps
it). In-place writes that leave the version as it is (``ops.assign``, ``copy_`` and
item writes do, in PyNative on CPU) need ``refresh_weights()`` after them. Under ``mindspore.jit`` in PyNative mode the check cannot run
inside the graph (reading a data pointer there waits for the graph itself): the
graph uses the weights as of the last eager / GRAPH_MODE call or ``build()``. Derived weights (a cast to fp16, the qkv fusion's
concatenated weight) are rebuilt with the graph, so fusion keeps working.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from atbcore.graph.graph_op import GraphOp as CoreGraphOp
from atbcore.tensor import TensorDesc, describe, is_tensor

from .._env import mindspore

__all__ = ["Block", "ParamSlot"]

_UNSET = object()


class ParamSlot:
    """Where one weight lives: ``get()`` the Parameter (or None), ``set(p)`` it;
    ``name`` is the Parameter's name (None: the Block's prefix + ``key``); ``where``:
    ``(mapping, key)`` whose ``mapping.get(key)`` is ``get()`` (a cheaper read)."""

    def __init__(self, key: str, get: Callable[[], Any], set_: Callable[[Any], None],
                 name: str | None = None, where: tuple[Any, str] | None = None) -> None:
        self.key, self.get, self.set, self.name, self.where = key, get, set_, name, where


def _signature(params: Sequence[Any]) -> tuple:
    # _version: MindSpore's in-place version counter, where it keeps one up to date
    return tuple((id(p), p.data_ptr(), tuple(p.shape), str(p.dtype), _version(p))
                 for p in params)


def _version(p: Any) -> int:
    return getattr(p, "_version", 0)


def new_parameter(array: Any, name: str) -> Any:
    """A Parameter sharing ``array``'s memory where possible."""
    ms = mindspore()
    from atbcore.tensor import from_numpy

    return ms.Parameter(from_numpy(array, "mindspore"), name=name, requires_grad=False)


class Block:
    """Owns a core GraphOp over ``layers`` (core Layers) or ``graph`` and keeps it in
    step with the Parameters reached through ``slots()``.

    ``slots()`` lists :class:`ParamSlot` objects; ``pull(layers_or_graph)`` returns
    the core's weights by key after a lowering (to create missing Parameters);
    ``push(params)`` hands Parameters back to the core layers before a build."""

    def __init__(self, make_core: Callable[[], CoreGraphOp], slots: Callable[[], list[ParamSlot]],
                 pull: Callable[[CoreGraphOp], dict[str, Any]],
                 push: Callable[[dict[str, Any]], None], prefix: Callable[[], str]) -> None:
        self._make, self._slots, self._pull, self._push, self._prefix = \
            make_core, slots, pull, push, prefix
        self.core: CoreGraphOp | None = None
        self._sig: tuple | None = None
        self._descs: list[TensorDesc] | None = None
        self._replay: list[Callable[[CoreGraphOp], Any]] = []

    # ------------------------------------------------------------------ building
    def _params(self) -> dict[str, Any]:
        return {s.key: s.get() for s in self._slots() if s.get() is not None}

    def ensure(self, descs: Sequence[TensorDesc], check: bool = True) -> CoreGraphOp:
        """The core GraphOp, built (and the Parameters created) at the first call and
        rebuilt when a Parameter changed (``check=False``: no check)."""
        from ..backend import blocked_reason

        if self.core is not None and (not check or blocked_reason()):
            # inside a pyfunc under mindspore.jit, asking a Parameter for its data
            # pointer waits for the running graph: use the weights of the last check
            return self.core
        params = self._params()
        if self.core is not None and _signature(list(params.values())) == self._sig:
            return self.core
        if self.core is not None:
            self.core.destroy()
        self._push(params)
        core = self._make()
        for fn in self._replay:
            fn(core)
        self._descs = list(descs)
        if core._framework is None:  # the layout pass packs for MindSpore's kernels
            core._framework = "mindspore"
        core._ensure_graph(self._descs)
        prefix = self._prefix()
        for slot in self._slots():
            if slot.get() is None:
                arr = self._pull(core).get(slot.key)
                if type(arr).__name__ == "PackedWeight":  # the graph holds it packed only
                    from atbcore.graph.packed import unpack
                    arr = unpack(arr)
                if arr is not None:
                    slot.set(new_parameter(arr, slot.name or f"{prefix}{slot.key}"))
        # new Parameters share the layers' NumPy weights (no copy): nothing to rebuild
        params = self._params()
        self.core = core
        self._sig = _signature(list(params.values()))
        return core

    def refresh(self) -> None:
        """Rebuild from the Parameters at the next call (after in-place writes)."""
        self._sig = None

    def replay(self, fn: Callable[[CoreGraphOp], Any]) -> None:
        """Apply ``fn`` to the core now and after every rebuild (plugins, shapes)."""
        self._replay.append(fn)
        if self.core is not None:
            fn(self.core)

    def rename(self) -> None:
        """Give every Parameter its name under the current prefix."""
        prefix = self._prefix()
        for s in self._slots():
            p = s.get()
            if p is not None:
                p.name = s.name or f"{prefix}{s.key}"

    # ------------------------------------------------------------------ running
    def descs(self, xs: Sequence[Any]) -> list[TensorDesc]:
        return [x if isinstance(x, TensorDesc) else describe(x) for x in xs
                if isinstance(x, TensorDesc) or is_tensor(x)]

    def call(self, xs: Sequence[Any], kv_cache: Any = _UNSET) -> Any:
        core = self.ensure(self._descs if self.core is not None and self._descs else
                           self.descs(xs))
        if kv_cache is not _UNSET:
            return core(*xs, kv_cache=kv_cache)
        if core._kv is not None and core._kv.slots and len(xs) == len(core.graph.inputs):
            outs = core.execute(list(xs))            # explicit cache tensors
            return outs[0] if len(outs) == 1 else tuple(outs)
        return core(*xs)

    def execute(self, arrays: Sequence[Any]) -> list:
        """All graph inputs given (GRAPH_MODE): run and return every output."""
        core = self.ensure(self._descs or self.descs(arrays))
        if len(arrays) == len(core.graph.inputs):
            return core.execute(list(arrays))
        out = core(*arrays)
        return list(out) if isinstance(out, tuple) else [out]

    def infer(self, descs: Sequence[TensorDesc]) -> list[TensorDesc]:
        core = self.ensure(self._descs or list(descs), check=False)
        if core._kv is not None and core._kv.slots and len(descs) < len(core.graph.inputs):
            descs = core._kv.empty_past_descs(list(descs))
            return core.infer_shape(descs)[:len(core.graph.outputs) - 2 * len(core._kv.slots)]
        return core.infer_shape(list(descs))

