"""``atb.GraphOp([...])`` as an ``nn.Module``.

    attn = atb.GraphOp([atb.LayerNorm(eps=1e-5),
                        atb.FlashAttention(num_heads=8, causal=True, kv_cache=True),
                        atb.Linear(out_features=512), atb.ResidualAdd()])
    y, kv = attn(x, kv_cache=kv)          # the seed's call
    attn.state_dict()                     # layers.<name>.<weight>, e.g. layers.linear.bias

* The layers are child modules (``self.layers``, keyed by layer name; unnamed ones
  get the core's auto names ``linear``, ``linear_1`` ...), so ``state_dict``,
  ``load_state_dict``, ``.to(dtype/device)``, ``parameters()`` work as usual. Their
  parameters are the core GraphOp's weights (see :mod:`atb_torch.graph_binding`).
* A call is one ``torch.ops.atb.graph_op`` (the fused, planned graph), so a model of
  GraphOps traces under ``torch.compile(fullgraph=True)`` as one node per GraphOp.
* KV caches (``FlashAttention(kv_cache=True)``): ``kv_cache=None`` starts empty and
  returns a dict holding this GraphOp's ``(key, value)`` per attention layer (the
  seed's loop ``x, kv = layer(x, kv_cache=kv)`` shares one dict across layers); a
  dict continues it; a list of ``(past_key, past_value)`` pairs is used as the past
  and the presents come back as pairs; an ``atb.KVCache`` object is read and
  appended in place by the core (eager only: it keeps host-side lengths, so under
  ``torch.compile`` pass the dict form instead). Tensors-only forms trace.
* Plugins: ``register_plugin(point, plugin)``; ``nn.Module`` forward (pre-)hooks on
  the GraphOp fire as on any module.
* Autograd: inference-only; with parameters or inputs requiring grad the forward
  works and ``backward`` raises :class:`AtbError` (never a silent zero gradient).
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.nn.parameter import UninitializedParameter, is_lazy

from atbcore.errors import AtbError, InputError, ParamsError
from atbcore.graph.graph_op import make_fusion_config
from atbcore.graph.ir import Graph
from atbcore.graph.layers import Layer as CoreLayer
from atbcore.graph.sequential import kv_cache_slots, lower_sequential
from atbcore.runtime.profiler import Profiler
from atbcore.tensor import TensorDesc

from . import profiling
from .devices import check_to_args
from .graph_binding import GraphRunner, desc_of, host_array, real_mode
from .graph_fast import FastCall
from .graph_views import GraphOpViews
from .graph_kv import KVSlotSpec, full_inputs, is_cache_object, pasts_of, run_guarded, store
from .library_graph import no_alias, register_runner
from .module_base import AtbModule
from .tensors import as_torch

__all__ = ["GraphOp"]

_UNSET: Any = object()
_CORE_KWARGS = ("dim_names", "dynamic_shape", "profile", "cuda_graph", "num_streams", "arena",
                "max_plans")


def _graph_op(*args: Any) -> list[Tensor]:
    return torch.ops.atb.graph_op(*args)


def _eager(xs: list[Tensor], weights: list[Tensor]) -> bool:
    """Whether a call may skip ``torch.ops.atb.graph_op``: not tracing, and no
    gradient could be asked for (the custom op is what refuses ``backward``)."""
    if torch.compiler.is_compiling():
        return False
    if not torch.is_grad_enabled():
        return True
    return not any(t.requires_grad for t in (*xs, *weights))


class GraphOp(GraphOpViews, nn.Module):
    """A fused block of atb layers as a module; see the module docstring.

    ``GraphOp(layers_or_graph, name=None, fusion_config=None, backend=None, **kw)``
    with the core GraphOp's keywords (``dim_names``, ``dynamic_shape``, ``profile``,
    ``cuda_graph``, ``num_streams``, ``arena``, ``max_plans``). A built core
    ``Graph`` (from ``GraphBuilder``) is accepted too: its weights become parameters.
    """

    def __init__(self, layers_or_graph: Sequence[AtbModule] | Graph, name: str | None = None,
                 fusion_config: Any = None, backend: str | None = None, *,
                 _borrow: bool = False, **kwargs: Any) -> None:
        super().__init__()
        bad = sorted(set(kwargs) - set(_CORE_KWARGS))
        if bad:
            raise ParamsError(name or "GraphOp", f"unknown keyword {bad[0]!r}",
                              f"one of {list(_CORE_KWARGS)}", bad[0])
        self.fusion_config, _ = make_fusion_config(fusion_config)
        self.backend, self.core_kwargs = backend, dict(kwargs)
        self.plugins: list[tuple[str, Any]] = []
        self._graph_src: Graph | None = None
        if isinstance(layers_or_graph, Graph):
            self.name = name or layers_or_graph.name
            self._init_from_graph(layers_or_graph)
        else:
            self.name = name or "graph_op"
            self._init_from_layers(layers_or_graph, _borrow)
        self._destroyed = False
        self._attach()

    def _attach(self) -> None:
        """A runner, handle, cache key and profiler of this very module (also after
        a copy: copies must not share the original's core or handle)."""
        self.profiler = profiling.track(Profiler(self.name))
        self._runner = GraphRunner(self)
        self._handle = register_runner(self._runner)
        self._key = f"{self.name}@{id(self):x}"
        self._weight_refs: tuple | None = None  # (layer ids, [(owner, name)]): weight_tensors
        self._materialized: tuple | None = None  # the layer ids whose shapes are known
        self._fast: FastCall | None = None  # the last plain eager call, guarded (graph_fast)

    def __getstate__(self) -> dict:
        state = dict(super().__getstate__())
        for k in ("_runner", "_handle", "_key", "profiler", "_fast"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._attach()
        for layer in (self.layers.values() if self._graph_src is None else ()):
            layer._graph_owners.add(self)

    # ------------------------------------------------------------------ construction
    def _init_from_layers(self, layers: Sequence[Any], borrow: bool) -> None:
        layers = list(layers) if isinstance(layers, (list, tuple, nn.ModuleList)) else None
        if not layers:
            raise InputError(self.name, "layers_or_graph", "a non-empty list of atb_torch layers "
                             "or a Graph", repr(layers)[:80])
        for i, l in enumerate(layers):
            if isinstance(l, CoreLayer):
                raise ParamsError(self.name, f"layer {i} is an atbcore layer",
                                  "an atb_torch layer (atb_torch.Linear, ...)", type(l).__name__)
            if not isinstance(l, AtbModule) or not l.graph_layer:
                raise ParamsError(self.name, f"layer {i} cannot be a GraphOp layer",
                                  "Linear, LayerNorm, RmsNorm, FlashAttention, RoPE, ResidualAdd, "
                                  "activations, FusedFeedForward, Softmax, Embedding, MoE, ...",
                                  type(l).__name__)
        from .modules import Linear
        from .modules_attention import FlashAttention, RoPE

        names = _auto_names(layers)
        self.layers = nn.ModuleDict(dict(zip(names, layers)))
        self._slots: list[KVSlotSpec] = []
        for i, l in enumerate(layers):
            if isinstance(l, FlashAttention):
                prev = layers[i - 1] if i else None
                packed = l.packed if l.packed is not None else isinstance(prev, Linear)
                if packed and l.has_projections:
                    l.drop_projections()
                elif not packed and not l.has_projections:
                    raise ParamsError(names[i], "FlashAttention on hidden states needs its "
                                      "q/k/v projections", "a layer not used packed elsewhere",
                                      "a layer whose projections were dropped")
                if l.kv_cache:
                    self._slots.append(KVSlotSpec(names[i], isinstance(prev, RoPE), l, prev))
            if not borrow:
                l._graph_owners.add(self)

    def _init_from_graph(self, graph: Graph) -> None:
        self._graph_src = graph
        self.weights = nn.ParameterDict()
        self._param_key: dict[str, str] = {}
        for tid, arr in graph.weights:
            key = re.sub(r"[^0-9A-Za-z_]", "_", tid)
            while key in self.weights:
                key += "_"
            self.weights[key] = nn.Parameter(as_torch(arr).clone())
            self._param_key[tid] = key
        slots = kv_cache_slots(graph)
        self._slots = [KVSlotSpec(s.layer, s.position_ids is not None, None, None,
                                  graph.desc_map[s.past_key].shape[-1]) for s in slots]

    # ------------------------------------------------------------------ weights
    def named_layers(self) -> list[tuple[str, AtbModule]]:
        return list(self.layers.items()) if self._graph_src is None else []

    def weight_ids(self) -> list[str]:
        """Graph weight ids, aligned with :meth:`weight_tensors`."""
        if self._graph_src is not None:
            return list(self._param_key)
        return [f"{n}.{k}" for n, m in self.named_layers() for k in m.core_weights()]

    def weight_tensors(self) -> list[Tensor]:
        """The parameters behind :meth:`weight_ids`, read from their owning modules
        each call (a replaced parameter is seen); where they live is looked up once
        per set of layers."""
        if self._graph_src is not None:
            return [self.weights[k] for k in self._param_key.values()]
        layers = tuple(self.layers.values())
        key, refs = tuple(map(id, layers)), self._weight_refs
        if refs is None or refs[0] != key:
            owners = []
            for m in layers:
                for qual in m.core_weights():
                    prefix, _, leaf = qual.rpartition(".")
                    owners.append((m.get_submodule(prefix) if prefix else m, leaf))
            refs = self._weight_refs = (key, owners)
        return [owner._parameters[leaf] for owner, leaf in refs[1]]

    def weight_places(self) -> list[tuple[dict, str]]:
        """Where each of :meth:`weight_tensors` is held now: ``(parameter dict, key)``
        (a parameter assigned there later replaces it)."""
        if self._graph_src is not None:
            return [(self.weights._parameters, k) for k in self._param_key.values()]
        self.weight_tensors()  # looks the owners up for the current layers
        assert self._weight_refs is not None
        return [(owner._parameters, leaf) for owner, leaf in self._weight_refs[1]]

    def core_source(self, host: Mapping[str, Any]) -> list[CoreLayer] | Graph:
        """Core layers (or the core graph) carrying the weights ``host`` (by graph id)."""
        if self._graph_src is not None:
            return self._graph_src.replace(
                weights=tuple((t, host.get(t, a)) for t, a in self._graph_src.weights))
        out = []
        for n, m in self.named_layers():
            mine = {k: host[f"{n}.{k}"] for k in m.core_weights() if f"{n}.{k}" in host}
            out.append(m.core_layer(n, mine))
        return out

    def _materialize(self, x: Tensor) -> None:
        """Give lazy parameters their shapes from a lowering for input ``x``."""
        pending = [(n, m) for n, m in self.named_layers() if m.has_lazy()]
        if not pending:
            return
        with real_mode():
            ids, params = self.weight_ids(), self.weight_tensors()
            host = {t: host_array(p) for t, p in zip(ids, params) if not is_lazy(p)}
            layers = self.core_source(host)
            lower_sequential(layers, [desc_of(x)], self.name)
        for (n, m), cl in zip(self.named_layers(), layers):
            if m.has_lazy():
                m.materialize({k: tuple(v.shape) for k, v in cl.weights().items()})

    def check_alive(self) -> None:
        if self._destroyed:
            raise AtbError(self.name, "GraphOp was destroyed", "a live GraphOp", "destroyed")

    # ------------------------------------------------------------------ calls
    def forward(self, *inputs: Any, kv_cache: Any = _UNSET) -> Any:
        """Run the block; ``(out, kv_cache)`` when called with ``kv_cache=``."""
        fast = self._fast
        if fast is not None and kv_cache is _UNSET:
            outs = fast(inputs)
            if outs is not None:
                return outs[0] if len(outs) == 1 else tuple(outs)
        if not inputs:
            raise InputError(self.name, "number of inputs", "at least 1", 0)
        xs = [as_torch(x, self.name) for x in inputs]
        if torch.compiler.is_compiling():
            if any(isinstance(p, UninitializedParameter) for p in self.parameters()):
                raise AtbError(self.name, "uninitialised parameters under torch.compile",
                               "one eager call or load_state_dict before compiling", "lazy")
        else:
            self.check_alive()
            layer_ids = tuple(map(id, self.layers.values())) if self._graph_src is None else ()
            if self._materialized != layer_ids:  # lazy shapes are set once per set of layers
                self._materialize(xs[0])
                self._materialized = layer_ids
        weights = self.weight_tensors()
        if not self._slots:
            if _eager(xs, weights):  # the core plan directly: no custom-op dispatch
                outs = no_alias(self._runner.run(xs, weights), xs, weights)
                self._fast = FastCall.after(self, xs, weights)
            else:
                outs = _graph_op(self._handle, xs, weights)
            out = outs[0] if len(outs) == 1 else tuple(outs)
            return out if kv_cache is _UNSET else (out, kv_cache)
        if is_cache_object(kv_cache):
            return self._call_cache_object(xs, weights, kv_cache)
        given = None if kv_cache is _UNSET else kv_cache
        full = full_inputs(xs, self._slots, pasts_of(self, given))
        outs = _graph_op(self._handle, full, weights)
        n = len(outs) - 2 * len(self._slots)
        presents = [(outs[n + 2 * i], outs[n + 2 * i + 1]) for i in range(len(self._slots))]
        out = outs[0] if n == 1 else tuple(outs[:n])
        return out if kv_cache is _UNSET else (out, store(self, kv_cache, presents))

    def _call_cache_object(self, xs: list[Tensor], weights: list[Tensor], cache: Any) -> Any:
        if torch.compiler.is_compiling():
            raise AtbError(self.name, "an atb.KVCache under torch.compile (it keeps host-side "
                           "lengths)", "kv_cache=None or a dict when compiling",
                           type(cache).__name__)
        core = self._runner.ready(xs, weights, lambda: [
            desc_of(t) for t in full_inputs(xs, self._slots, [None] * len(self._slots))])
        return run_guarded(self.name, lambda: core(*xs, kv_cache=cache), [*xs, *weights])

    def execute(self, inputs: Sequence[Any], outputs: list | None = None) -> list:
        """The core's ``execute``: all graph inputs in graph order (cache inputs
        included); with ``outputs``, results are copied into them."""
        xs = [as_torch(x, self.name) for x in inputs]
        self._materialize(xs[0])
        weights = self.weight_tensors()
        core = self._runner.ensure_core([desc_of(x) for x in xs])
        self._runner.bind(core, weights)
        return run_guarded(self.name, lambda: core.execute(xs, outputs), [*xs, *weights])

    def infer_shape(self, inputs: Sequence[Any]) -> list[TensorDesc]:
        """Output descriptors for all graph inputs given as tensors or TensorDescs."""
        descs = [x if isinstance(x, TensorDesc) else desc_of(as_torch(x, self.name))
                 for x in inputs]
        return self._runner.ensure_core(descs).infer_shape(descs)

    def to(self, *args: Any, **kwargs: Any) -> "GraphOp":
        """``nn.Module.to``, refusing devices atb cannot use with an AtbError."""
        check_to_args(args, kwargs, self.name)
        return super().to(*args, **kwargs)

    # ------------------------------------------------------------------ plugins
    def register_plugin(self, point: str, plugin: Any) -> "GraphOp":
        """Run ``plugin`` (an ``atb.Plugin``) at ``point``: pre/post_attention,
        pre/post_mlp, pre/post_block."""
        from atbcore.plugin import POINTS

        if point not in POINTS:
            raise ParamsError(self.name, "plugin point", list(POINTS), repr(point))
        if not (hasattr(plugin, "preprocess") or hasattr(plugin, "postprocess")):
            raise ParamsError(self.name, "plugin", "an object with preprocess/postprocess "
                              "(an atb.Plugin)", type(plugin).__name__)
        self.plugins.append((point, plugin))
        self._fast = None
        if self._runner.core is not None:
            self._runner.core.register_plugin(point, plugin)
        return self

    # ------------------------------------------------------------------ lifetime
    def destroy(self) -> None:
        """Free the plans; the module can no longer run."""
        if self._runner.core is not None:
            self._runner.core.destroy()
        self._destroyed = True
        self._fast = None

    def __enter__(self) -> "GraphOp":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    def __iter__(self):
        return iter(self.layers.values()) if self._graph_src is None else iter(())

    def __len__(self) -> int:
        return len(self.layers) if self._graph_src is None else 0

    def __getitem__(self, i: int | str) -> AtbModule:
        if isinstance(i, str):
            return self.layers[i]
        return list(self.layers.values())[i]

    def extra_repr(self) -> str:
        return f"{self.name!r}"


def _auto_names(layers: Sequence[AtbModule]) -> list[str]:
    """Layer names: the user's, else the core's stems ``linear``, ``linear_1`` ..."""
    reserved = {l.name for l in layers if l.name}
    used: set[str] = set()
    out = []
    for l in layers:
        if l.name:
            if l.name in used:
                raise ParamsError("GraphOp", f"layer name {l.name!r} used twice", "unique names",
                                  l.name)
            name = l.name
        else:
            stem, k = getattr(l, "kind", "layer"), 0
            name = stem
            while name in used or name in reserved:
                k += 1
                name = f"{stem}_{k}"
        if "." in name or hasattr(nn.ModuleDict, name):
            raise ParamsError("GraphOp", "layer name", "a name without '.' that is not a "
                              "ModuleDict attribute", repr(name))
        used.add(name)
        out.append(name)
    return out
