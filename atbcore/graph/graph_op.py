"""``GraphOp``: declare a block once; atb fuses, schedules, memory-plans and runs it.

    block = GraphOp([LayerNorm(eps=1e-5), Linear(out_features=4 * H), SiLU(),
                     Linear(out_features=H), ResidualAdd()])
    y = block(x)                      # any framework's tensor in, the same framework out
    print(block.explain())            # nodes before/after fusion, kernels, launches, arena

From a list of seed-style layers the graph is lowered at the first call, when the
input descriptors are known; a :class:`~atbcore.graph.ir.Graph` is used as given.
Then the pass pipeline runs once (``fusion_config``: a ``FusionConfig`` or a dict of
the seed's keys), and each input signature (bucket) gets a compiled plan from the
plan cache (``atbcore.runtime.plan_cache``).

Plugin points (``register_plugin(point, plugin)``), on the graph after fusion:

* ``pre_block`` / ``post_block``: the graph's inputs before anything runs / its
  outputs after everything ran (with KV caches: the past and present tensors too);
* ``pre_attention`` / ``post_attention``: the activation inputs (not weights) of each
  attention node (FlashAttention, PagedAttention) / its outputs;
* ``pre_mlp`` / ``post_mlp``: the MLP span. A FusedFeedForward or MoE node is a span
  of its own. In a graph without one, the span runs from the first Linear whose
  output feeds an activation (SiLU, Gelu, SwiGLU, ...) to the last Linear reachable
  from that activation: ``pre_mlp`` sees the first Linear's activation inputs,
  ``post_mlp`` the last Linear's outputs (so in LayerNorm -> Linear -> SiLU -> Linear
  -> ResidualAdd it wraps Linear..Linear, before the residual add);
* ``rope``: each RoPE node; a rope plugin (``rope(payload)`` or a global
  ``atb_rope`` hook) replaces its rotation of q and k, in both KV-cache forms
  (see :mod:`atbcore.plugin.rope_point`).

``preprocess`` / ``atb_preprocess`` run at the pre points only, ``postprocess`` /
``atb_postprocess`` at the post points only. Plugins receive and return tensors of
the caller's framework (converted zero-copy; Paddle by copy), and, when they name a
``payload`` parameter, the point's typed payload (:mod:`atbcore.plugin.payloads`).
With no plugin the plan runs without any point hook.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Mapping, Sequence

from ..errors import AtbError, InputError, ParamsError, ShapeError, DtypeError
from ..operation import check_writable
from ..runtime.executor import ExecPlan, build_plan, infer_descs, native_weight
from ..runtime.plan_cache import PlanCache
from ..runtime.profiler import Profiler
from ..runtime.scheduler import schedule
from ..tensor import (TensorDesc, convert, copy_into, describe, framework_of, is_tensor,
                      raw_signature)
from .graph_op_explain import GraphOpPlugins, GraphOpViews, plugin_points
from .graph_op_hot import GraphOpHot
from .graph_op_io import load_graph_op_kwargs, make_fusion_config, save_graph_op
from .graph_op_kv import KVBinder, in_place_cache, kv_dim_names, run_in_place
from .ir import Graph

__all__ = ["GraphOp"]

_UNSET: Any = object()  # kv_cache not passed (None is a value: "start a cache")


class GraphOp(GraphOpHot, GraphOpPlugins, GraphOpViews):
    """A fused, planned graph of ops; see the module docstring.

    ``GraphOp(layers_or_graph, name=None, fusion_config=None, backend=None, *,
    dim_names=None, dynamic_shape=None, profile=None, cuda_graph=False, num_streams=1,
    arena="auto", max_plans=32)``. ``dim_names`` names input dims for dynamic shapes
    (see :mod:`atbcore.runtime.plan_cache`); ``profile`` records per-node times
    (default: ``get_config().enable_profiling``); ``cuda_graph`` captures plans as
    CUDA graphs on CUDA inputs; ``num_streams > 1`` runs independent branches on
    separate CUDA streams.
    """

    def __init__(self, layers_or_graph: Sequence[Any] | Graph, name: str | None = None,
                 fusion_config: Any = None, backend: str | None = None, *,
                 dim_names: Mapping[str, Sequence[str | None]] | None = None,
                 dynamic_shape: Mapping[str, Any] | None = None, profile: bool | None = None,
                 cuda_graph: bool = False, num_streams: int = 1, arena: str = "auto",
                 max_plans: int = 32) -> None:
        if isinstance(layers_or_graph, Graph):
            self._layers, self.graph_unfused = None, layers_or_graph
        elif isinstance(layers_or_graph, (list, tuple)) and layers_or_graph:
            self._layers, self.graph_unfused = list(layers_or_graph), None
        else:
            raise InputError(name or "GraphOp", "layers_or_graph",
                             "a non-empty list of layers or a Graph", repr(layers_or_graph)[:80])
        if arena not in ("auto", "always", "never"):
            raise ParamsError("GraphOp", "arena", "auto/always/never", repr(arena))
        self.name = name or (self.graph_unfused.name if self.graph_unfused else "graph_op")
        self.fusion_config, self.fusion_extra = make_fusion_config(fusion_config)
        self.backend = backend
        self.dim_names = dict(dim_names or {})
        self.profile = profile
        self.cuda_graph = cuda_graph
        self.num_streams = int(num_streams)
        self.arena = arena
        self.max_plans = max_plans
        self.profiler = Profiler(self.name)
        self._dynamic = dict(dynamic_shape or {})
        self._plugins: dict[str, list[Any]] = {}
        from ..memory.hugepages import Arena
        self._weight_arena = Arena()  # its prepared weights (the in-place form shares it)
        # weights its lowerings concatenate or pack, made once for all of them
        # (passes.rewrite.weight_memo; the in-place form shares it too)
        self._weight_memo: dict = {}
        # the first call's framework, whose kernels the layout pass asks (passes.layout)
        self._framework: str | None = None
        self._reset_state()

    def _reset_state(self) -> None:
        """The lowering, plans and run state (also a fresh start for the in-place
        cache form, which copies this GraphOp's settings)."""
        self.graph: Graph | None = None  # after the pass pipeline
        self.pass_reports: list[Any] = []
        self.last_launches: int | None = None
        self.last_plan: ExecPlan | None = None
        self._cache: PlanCache | None = None
        self._weights: dict[tuple[str, str, str], Any] = {}
        self._captured: dict[tuple, Any] = {}
        self._points: dict[str, tuple[str | None, str | None]] = {}
        self._point_info: Any = None  # graph_op_points.PointInfo of self.graph
        self._kv: KVBinder | None = None
        self._destroyed = False
        self._lock = threading.RLock()  # plan lookup and building; runs: the arena's lock
        self._finalizer: Any = None
        # (raw signature, plan, program key, framework) of the last plain call
        self._hot: tuple | None = None
        self._in_place: Any = None  # the in-place cache form (graph_op_kv.in_place_form)
        self._cache_form: tuple | None = None  # (cache layer desc, batch) when this is one
        self._feeder: Any = None  # its graph_op_kv.CacheFeeder
        self._trusted: frozenset[str] = frozenset()  # inputs atb made (build_plan's trusted)

    # ------------------------------------------------------------------ building
    def _descs_of(self, inputs: Sequence[Any]) -> list[TensorDesc]:
        out = []
        for i, x in enumerate(inputs):
            if isinstance(x, TensorDesc):
                out.append(x)
            elif is_tensor(x):
                out.append(describe(x))
                if self._framework is None:
                    self._framework = framework_of(x)
            else:
                raise InputError(self.name, f"input {i} type", "a tensor or TensorDesc",
                                 type(x).__name__)
        return out

    def _ensure_graph(self, descs: Sequence[TensorDesc]) -> Graph:
        """Lower (layers), fuse (pipeline) and set up the plan cache, once."""
        if self.graph is not None:
            return self.graph
        if self.graph_unfused is None:
            from .sequential import lower_sequential
            cache_desc, batch = self._cache_form or (None, 1)
            self.graph_unfused = lower_sequential(self._layers, list(descs), self.name,
                                                  kv_cache_desc=cache_desc, batch=batch)
        from ..passes.pipeline import PassReport, run_pipeline
        from ..passes.rewrite import weight_memo
        from ..memory.hugepages import arena_scope  # packed weights side by side
        with weight_memo(self._weight_memo), arena_scope(self._weight_arena):
            self.graph, self.pass_reports = run_pipeline(self.graph_unfused,
                                                         self._fusion_for_plugins(descs),
                                                         framework=self._framework,
                                                         backend=self.backend)
            if self._layers is not None:  # layers and unfused graph keep the packed form
                from ..passes.layout import share_with_layers
                self.graph_unfused = share_with_layers(self._layers, self.graph,
                                                       self._weight_memo, self.graph_unfused)
        self.pass_reports += [PassReport(f"device:{rule}", False, f"kept off: {why}")
                              for rule, why in self._device_unfused(descs).items()]
        self._points = plugin_points(self.graph)
        self._kv = KVBinder(self.graph, f"{self.name}@{id(self):x}")
        # The cache must not keep this GraphOp alive (its finalizer releases the cache).
        build = weakref.WeakMethod(self._build)
        self._cache = PlanCache(lambda d, fw: build()(d, fw), name=self.name, inputs=self.graph.inputs,
                                dim_names={**kv_dim_names(self.graph), **self.dim_names},
                                dynamic_shape=self._dynamic,
                                max_plans=self.max_plans, backend=self.backend)
        # A GraphOp dropped without destroy() still gives its arenas back to the pool.
        self._finalizer = weakref.finalize(self, PlanCache.clear, self._cache)
        return self.graph

    def _build(self, descs: Mapping[str, TensorDesc], framework: str | None) -> ExecPlan:
        assert self.graph is not None
        plan = build_plan(self.graph, descs, backend=self.backend, weights=self._weight,
                          points=self._points, num_streams=self.num_streams,
                          arena=self._cache.arena if self.arena != "never" else "never",
                          framework=framework, trusted=self._trusted)
        # the weight layouts its kernels prepare (panels) lie side by side on huge pages
        plan.weight_arena = self._weight_arena
        return plan

    def _weight(self, tid: str, native: str, device: str) -> Any:
        # Weights become backend-native once per (native, device), shared by all plans.
        key = (tid, native, device)
        if key not in self._weights:
            assert self.graph is not None
            self._weights[key] = native_weight(self.graph.weight_map[tid], native, device)
        return self._weights[key]

    def _bind_inputs(self, inputs: Sequence[Any]) -> dict[str, Any]:
        assert self.graph is not None
        if len(inputs) != len(self.graph.inputs):
            raise InputError(self.name, "number of inputs",
                             f"{len(self.graph.inputs)} ({', '.join(self.graph.inputs)})",
                             len(inputs))
        return dict(zip(self.graph.inputs, inputs))

    def plan_for(self, inputs: Sequence[Any]) -> tuple[ExecPlan, dict[str, TensorDesc]]:
        """The compiled plan (from the cache) for inputs given as tensors or descriptors."""
        self._check_alive()
        raw = raw_signature(inputs)
        with self._lock:
            if raw is not None and self._cache is not None:
                hit = self._cache.get_raw(raw)
                if hit is not None:
                    self.last_plan = hit[0]
                    return hit
            descs = self._descs_of(inputs)
            self._ensure_graph(descs)
            assert self._cache is not None
            fw = next((framework_of(x) for x in inputs if not isinstance(x, TensorDesc)), None)
            plan, exact = self._cache.get(self._bind_inputs(descs), fw, raw)
            self.last_plan = plan
            return plan, exact

    # ------------------------------------------------------------------ running
    def __call__(self, *inputs: Any, kv_cache: Any = _UNSET) -> Any:
        """Run; returns the output (a tuple when the graph has several), or
        ``(output, kv_cache)`` when called with ``kv_cache=`` (``None`` included;
        see :mod:`atbcore.graph.graph_op_kv` for the cache forms)."""
        inputs = list(inputs)
        if not inputs:
            raise InputError(self.name, "number of inputs", "at least 1", 0)
        self._check_alive()
        if self.graph is None:
            self._ensure_graph(self._descs_of(inputs))
        kv = self._kv
        if kv is None or not kv.slots:
            outs = self.execute(inputs)
            out = outs[0] if len(outs) == 1 else tuple(outs)
            return out if kv_cache is _UNSET else (out, kv_cache)
        if in_place_cache(kv_cache) and len(inputs) == 1:
            out = run_in_place(self, inputs[0], kv_cache)
            if out is not None:
                return out, kv_cache
        given = None if kv_cache is _UNSET else kv_cache
        full, plens = kv.inputs(inputs, given)
        outs = self.execute(full)
        state = kv.store(outs, given, plens)
        n_main = len(outs) - 2 * len(kv.slots)
        out = outs[0] if n_main == 1 else tuple(outs[:n_main])
        return out if kv_cache is _UNSET else (out, state)

    def execute(self, inputs: Sequence[Any], outputs: list | None = None) -> list:
        """Run on a list of tensors (any framework); returns the list of outputs in
        the first input's framework. With ``outputs``, results are copied into those
        tensors (checked first; nothing is written when the run fails)."""
        inputs = list(inputs)
        if outputs is None:
            hot = self._run_hot(inputs)
            if hot is not None:
                return hot
        for i, x in enumerate(inputs):
            if isinstance(x, TensorDesc):
                raise InputError(self.name, f"input {i} has no data", "a tensor", repr(x))
        if not inputs:
            raise InputError(self.name, "number of inputs", "at least 1", 0)
        plan, exact = self.plan_for(inputs)
        if outputs is not None:
            self._check_outputs(outputs, [exact[o] for o in plan.graph.outputs])
        framework = framework_of(inputs[0])
        hook = self._hook(framework, plan) if self._plugins_active() else None
        if hook is not None:
            inputs = hook("pre_block", "", inputs)
        native = {k: convert(x, plan.entry_native)
                  for k, x in self._bind_inputs(inputs).items()}
        results = self._run_plan(plan, exact, native, hook)
        results = [convert(r, framework) for r in results]
        if hook is None and not self.cuda_graph and outputs is None:
            # remembered for the next call of the same signature (see _run_hot)
            self._hot = (raw_signature(inputs), plan, plan.program_key(exact), framework)
        if hook is not None:
            results = hook("post_block", "", results)
        if outputs is None:
            return results
        for i, (slot, r) in enumerate(zip(outputs, results)):
            if slot is None or isinstance(slot, TensorDesc):
                outputs[i] = r
            else:
                copy_into(slot, r)
        return outputs

    def _run_plan(self, plan: ExecPlan, exact: Mapping[str, TensorDesc],
                  native: dict[str, Any], hook: Any) -> list:
        if self.cuda_graph and hook is None and plan.device.startswith("cuda"):
            from ..runtime.cuda import capture_or_none

            out = capture_or_none(self, plan, exact, native)
            if out is not None:
                return out
        prof = self.profiler if self._profiling() else None
        out = plan.run(native, descs=exact, profiler=prof, hook=hook)
        self.last_launches = plan.launches
        return out

    def _check_outputs(self, outputs: list, want: list[TensorDesc]) -> None:
        if len(outputs) != len(want):
            raise InputError(self.name, "number of outputs", len(want), len(outputs))
        for i, (slot, w) in enumerate(zip(outputs, want)):
            if slot is None or isinstance(slot, TensorDesc):
                continue
            check_writable(self.name, f"output {i}", slot)
            got = describe(slot)
            if tuple(got.shape) != tuple(w.shape):
                raise ShapeError(self.name, f"output {i} shape", list(w.shape), list(got.shape))
            if got.dtype != w.dtype:
                raise DtypeError(self.name, f"output {i} dtype", w.dtype.name, got.dtype.name)

    def infer_shape(self, inputs: Sequence[Any]) -> list[TensorDesc]:
        """Output descriptors for inputs given as tensors or :class:`TensorDesc`.
        For a block with KV caches, the block's own inputs alone mean an empty past
        (the outputs then include the present keys/values)."""
        self._check_alive()
        descs = self._descs_of(list(inputs))
        graph = self._ensure_graph(descs)
        if self._kv is not None and self._kv.slots and len(descs) == len(self._kv.user_inputs):
            descs = self._kv.empty_past_descs(descs)
        bound = self._bind_inputs(descs)
        assert self._cache is not None
        self._cache.check(bound)
        all_descs, _ = infer_descs(graph, schedule(graph), bound)
        return [all_descs[o] for o in graph.outputs]

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | os.PathLike) -> str:
        """Save the graph before fusion (JSON + safetensors, bit-exact) and this
        GraphOp's settings; :meth:`load` re-runs the same fusion."""
        return save_graph_op(self, directory)

    @classmethod
    def load(cls, directory: str | os.PathLike, **overrides: Any) -> "GraphOp":
        """A GraphOp from :meth:`save`'s directory (keywords override saved settings)."""
        return cls(**load_graph_op_kwargs(directory, overrides))

    # ------------------------------------------------------------------ lifetime
    def destroy(self) -> None:
        """Free every plan's arena back to the pool and drop cached weights; the
        GraphOp can no longer run."""
        with self._lock:
            if self._in_place:  # False: the block cannot take the in-place form
                self._in_place.destroy()
            if self._cache is not None:
                self._cache.clear()
            self._captured.clear()
            self._weights.clear()
            self.last_plan = None
            self._destroyed = True

    def _check_alive(self) -> None:
        if self._destroyed:
            raise AtbError(self.name, "GraphOp was destroyed", "a live GraphOp", "destroyed")

    def __enter__(self) -> "GraphOp":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    def __repr__(self) -> str:
        n = len(self.graph.nodes) if self.graph else "?"
        return f"GraphOp({self.name!r}, nodes={n})"
