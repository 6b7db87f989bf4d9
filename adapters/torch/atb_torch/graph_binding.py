"""Binding an ``atb_torch.GraphOp`` module's parameters into the core GraphOp.

The core graph is lowered and fused once per input dtype (the graph's weights are
cast to the input dtype, as the core layers do). Its weights are then *bound* to
the module's parameters:

* a weight that survives fusion unchanged (``"<layer>.<name>"``) is the parameter
  tensor itself (``param.detach()``: same storage, zero-copy; a dtype cast only when
  the parameter's dtype differs from the graph's);
* a weight that fusion derived (the merged QKV or gate/up matrices) is recomputed
  by lowering and fusing again with the current values.

The binding is keyed by each parameter's storage, dtype, device, shape and version
counter, so ``.to(...)``, ``.half()``, ``load_state_dict`` (in-place copies bump
the version) and in-place edits are seen at the next call, and the plans are
rebuilt with the new tensors. Nothing is copied while parameters stay as they are.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from atbcore.dtypes import Dtype
from atbcore.errors import AtbError
from atbcore.graph.graph_op import GraphOp as CoreGraphOp
from atbcore.graph.ir import Graph
from atbcore.runtime.executor import native_weight
from atbcore.tensor import TensorDesc, convert, to_numpy

from .devices import check_devices

__all__ = ["BoundCore", "GraphRunner", "real_mode", "desc_of"]


@contextlib.contextmanager
def real_mode() -> Iterator[None]:
    """Leave any active fake-tensor mode (fake kernels build the core graph from the
    module's real parameters)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        yield


def desc_of(t: Tensor) -> TensorDesc:
    """A TensorDesc of a real or fake tensor (symbolic sizes are specialised)."""
    dev = t.device.type if t.device.index is None else f"{t.device.type}:{t.device.index}"
    return TensorDesc(tuple(int(s) for s in t.shape), Dtype.of(t.dtype), device=dev)


def host_array(t: Tensor) -> Any:
    t = t.detach()
    return to_numpy(t if t.device.type == "cpu" else t.cpu())


def _sig(weights: list[Tensor]) -> tuple:
    return tuple((w.data_ptr(), w._version, w.dtype, str(w.device), tuple(w.shape))
                 for w in weights)


def _unchanged(seen: list[tuple[Tensor, int, int]], weights: list[Tensor]) -> bool:
    """Whether ``weights`` are the very tensors of ``seen``, unmodified and in place."""
    return len(seen) == len(weights) and all(
        w is t and w._version == v and w.data_ptr() == a for (t, v, a), w in zip(seen, weights))


class BoundCore(CoreGraphOp):
    """The core GraphOp, reading bound torch tensors as its weights."""

    _bound: dict[str, Tensor] = {}

    def _weight(self, tid: str, native: str, device: str) -> Any:
        t = self._bound.get(tid)
        if t is None:
            return super()._weight(tid, native, device)
        if native == "torch":
            return t
        return native_weight(host_array(t), native, device)

    def rebind(self, bound: dict[str, Tensor]) -> None:
        """Use ``bound`` from now on; plans holding old weights are dropped."""
        self._bound = bound
        if self._in_place:  # the in-place cache form reads the same weights
            self._in_place.rebind(bound)
        self._weights.clear()
        self._captured.clear()
        if self._cache is not None:
            self._cache.clear()


class GraphRunner:
    """What ``torch.ops.atb.graph_op`` runs for one GraphOp module (held weakly)."""

    def __init__(self, module: Any) -> None:
        self._module = weakref.ref(module)
        self.name = module.name
        self.core: BoundCore | None = None
        self.dtype: Dtype | None = None
        self._sig: tuple | None = None
        self._built_sig: tuple | None = None
        # (input dtype, device, [(weight, version, address)]) of the last checked call:
        # while they hold, a call skips the device checks, descriptors and weight binding
        self._seen: tuple | None = None

    @property
    def module(self) -> Any:
        m = self._module()
        if m is None:
            raise AtbError(self.name, "GraphOp module was garbage-collected", "a live module",
                           "none")
        return m

    # ------------------------------------------------------------------ building
    def ensure_core(self, descs: list[TensorDesc]) -> BoundCore:
        """The core GraphOp for inputs of these descriptors (built once per dtype)."""
        if self.core is not None and self.dtype == descs[0].dtype:
            return self.core
        m = self.module
        m.check_alive()
        ids, params = m.weight_ids(), m.weight_tensors()
        with real_mode():  # the core warns here once about unused extra inputs
            source = m.core_source({t: host_array(p) for t, p in zip(ids, params)})
            core = BoundCore(source, name=m.name, fusion_config=m.fusion_config,
                             backend=m.backend, **m.core_kwargs)
            core.profiler = m.profiler
            for point, plugin in m.plugins:
                core.register_plugin(point, plugin)
            core.infer_shape(descs)  # lowers and fuses now
        if self.core is not None:
            self.core.destroy()
        self.core, self.dtype = core, descs[0].dtype
        self._sig, self._built_sig, self._seen = None, _sig(params), None
        return core

    def _derived(self, core: BoundCore, ids: list[str], weights: list[Tensor]) -> dict[str, Any]:
        """Fused weights recomputed from the current values."""
        from atbcore.graph.sequential import lower_sequential
        from atbcore.passes.pipeline import run_pipeline

        assert core.graph_unfused is not None
        g0 = core.graph_unfused
        with real_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # said at the first lowering
            source = self.module.core_source({t: host_array(w) for t, w in zip(ids, weights)})
            if not isinstance(source, Graph):
                source = lower_sequential(source, [g0.desc_map[i] for i in g0.inputs], core.name)
            fused, _ = run_pipeline(source, core.fusion_config)
        return fused.weight_map

    def bind(self, core: BoundCore, weights: list[Tensor]) -> None:
        """Make the core read ``weights`` (aligned with the module's weight ids)."""
        sig = _sig(weights)
        if sig == self._sig and core._bound:
            return
        ids = self.module.weight_ids()
        by_id = dict(zip(ids, weights))
        assert core.graph is not None
        wmap = core.graph.weight_map
        bound: dict[str, Tensor] = {}
        for tid, arr in wmap.items():
            if tid in by_id:
                want = Dtype.of(arr.dtype).torch
                t = by_id[tid].detach()
                bound[tid] = t if t.dtype == want else t.to(want)
        derived = [t for t in wmap if t not in by_id]
        if derived:
            with real_mode():
                fresh = wmap if sig == self._built_sig else self._derived(core, ids, weights)
                dev = weights[0].device if weights else torch.device("cpu")
                for tid in derived:
                    bound[tid] = convert(fresh[tid], "torch").to(dev)
        core.rebind(bound)
        self._sig = sig

    # ------------------------------------------------------------------ calls
    def ready(self, inputs: list[Tensor], weights: list[Tensor],
              descs: Callable[[], list[TensorDesc]] | None = None) -> BoundCore:
        """The core, built and bound for these inputs and weights (``descs()``: the
        core graph's input descriptors, when not those of ``inputs``); a call with
        the last one's dtype, device and unchanged weights checks nothing more."""
        core, seen = self.core, self._seen
        if (core is None or seen is None or inputs[0].dtype != seen[0]
                or any(x.device != seen[1] for x in inputs) or not _unchanged(seen[2], weights)):
            check_devices(self.name, [*inputs, *weights])
            core = self.ensure_core(descs() if descs is not None else
                                    [desc_of(x) for x in inputs])
            self.bind(core, weights)
            self._seen = (inputs[0].dtype, inputs[0].device,
                          [(w, w._version, w.data_ptr()) for w in weights])
        return core

    def run(self, inputs: list[Tensor], weights: list[Tensor]) -> list[Tensor]:
        """Run the fused plan on real tensors (the real kernel of graph_op)."""
        return self.ready(inputs, weights).execute(inputs)

    def fake(self, inputs: list[Tensor], weights: list[Tensor]) -> list[Tensor]:
        """Output tensors of the right shapes for fake inputs (the fake kernel)."""
        descs = [desc_of(x) for x in inputs]
        with real_mode():
            outs = self.ensure_core(descs).infer_shape(descs)
        dev = inputs[0].device
        return [torch.empty(d.shape, dtype=d.dtype.torch, device=dev) for d in outs]
