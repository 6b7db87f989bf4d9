"""A GraphOp model's decode step as ONE core program (``compile()``, opt_level >= 2).

The seed's ``AcceleratedLLaMA`` calls 17 GraphOps per token (an attention and an MLP
block per layer, and the LM head), each a Python call with its own checks, cache
feeding and program. ``compile()`` records one real decode step of such a model —
which modules it called, in which order, on which tensors — and, when the step is a
straight line of

* atb GraphOps (``kv_cache=`` the model's ``atb.KVCache`` or none),
* ``nn.Embedding``, ``nn.LayerNorm``, ``nn.RMSNorm`` and ``nn.Linear``,

each reading the previous one's output, with no other torch operation in between,
the whole step becomes one core GraphOp: the GraphOps' layers as :class:`Block`\\ s
(``atbcore.graph.layers_block``) between the other modules' core layers. The one
pass pipeline fuses across the blocks (a block's residual add goes into the next
block's GEMM), the plan is bound once, and the cache layers are the very ones the
blocks wrote (:func:`atbcore.graph.graph_op_kv.share_cache_layers`). Weights are the
blocks' bound tensors themselves (same objects: the packed weight layouts are
shared, not copied). Anything else (a torch op in ``forward``, a plugin on a
GraphOp, a GraphOp loaded from a saved graph, two caches) keeps the call-by-call
path; :func:`record` says why.

The program is rebuilt when a GraphOp rebinds its weights (a changed parameter).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from atbcore.dtypes import Dtype
from atbcore.errors import CapabilityError
from atbcore.graph import layers as L
from atbcore.graph.graph_op_kv import cache_layers, in_place_cache, share_cache_layers
from atbcore.graph.layers_block import Block, flat_layers

from ..graph import GraphOp
from ..graph_binding import BoundCore, desc_of, host_array
from ..graph_layers import OpLayer

__all__ = ["record", "StepProgram"]

_NN = (torch.nn.Embedding, torch.nn.LayerNorm, torch.nn.RMSNorm, torch.nn.Linear)
# what forward may ask of a tensor between the modules (nothing computed)
_FREE = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.__len__,
         torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
         torch.Tensor.ndim.__get__}


class _Watch(TorchFunctionMode):
    """Counts torch functions called outside the recorded modules."""

    def __init__(self) -> None:
        super().__init__()
        self.depth, self.foreign = 0, []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.depth == 0 and func not in _FREE:
            self.foreign.append(getattr(func, "__name__", repr(func)))
        return func(*args, **(kwargs or {}))


def _modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The GraphOps and plain nn layers of ``model`` (not looking inside them)."""
    out: list[tuple[str, torch.nn.Module]] = []

    def walk(prefix: str, m: torch.nn.Module) -> None:
        for name, child in m._modules.items():
            if child is None:
                continue
            q = f"{prefix}{name}"
            if isinstance(child, GraphOp) or type(child) in _NN:
                out.append((q, child))
            else:
                walk(q + ".", child)
    walk("", model)
    return out


def record(model: torch.nn.Module, ids: torch.Tensor) -> tuple[Any, list | None, str]:
    """Run ``model(ids)`` once, watching it: ``(output, steps, why_not)`` where
    ``steps`` are ``(name, module, cache)`` in call order when the step is a straight
    line (see the module docstring), else None with the reason."""
    calls: list[tuple[str, torch.nn.Module, tuple, dict, Any]] = []
    watch = _Watch()
    handles = []
    for name, mod in _modules(model):
        def pre(m: Any, args: Any, kwargs: Any) -> None:
            watch.depth += 1

        def post(m: Any, args: Any, kwargs: Any, out: Any, name: str = name) -> None:
            watch.depth -= 1
            if watch.depth == 0:
                calls.append((name, m, args, kwargs, out))
        handles += [mod.register_forward_pre_hook(pre, with_kwargs=True),
                    mod.register_forward_hook(post, with_kwargs=True)]
    try:
        with watch:
            out = model(ids)
    finally:
        for h in handles:
            h.remove()
    if watch.foreign:
        return out, None, f"forward computes outside its modules ({', '.join(watch.foreign[:3])})"
    steps, why = _chain(calls, ids, out)
    return out, steps, why


def _chain(calls: list, ids: torch.Tensor, out: Any) -> tuple[list | None, str]:
    steps, cur, caches = [], ids, set()
    for name, m, args, kwargs, got in calls:
        if len(args) != 1 or args[0] is not cur or set(kwargs) - {"kv_cache"}:
            return None, f"{name} does not read the previous module's output alone"
        cache = kwargs.get("kv_cache")
        if "kv_cache" in kwargs and not in_place_cache(cache):
            return None, f"{name}'s kv_cache is not an atb.KVCache ({type(cache).__name__})"
        if cache is not None:
            if not (isinstance(got, tuple) and len(got) == 2 and got[1] is cache):
                return None, f"{name} does not return its KVCache"
            got = got[0]
            caches.add(id(cache))
        why = _why_not_module(name, m, cache)
        if why:
            return None, why
        steps.append((name, m, cache))
        cur = got
    if not steps or cur is not out:
        return None, "forward's result is not its last module's output"
    if len(caches) > 1:
        return None, "the GraphOps use more than one KVCache"
    return steps, ""


def _why_not_module(name: str, m: Any, cache: Any) -> str:
    if isinstance(m, GraphOp):
        core = m._runner.core
        if m._graph_src is not None or core is None or core._layers is None:
            return f"{name} is a GraphOp of a saved graph (no layers)"
        if m.plugins:
            return f"{name} has plugins (they run per call)"
        if cache is not None and cache_layers(core, cache) is None:
            return f"{name} has not written the cache in place"
        return ""
    if isinstance(m, torch.nn.Embedding) and m.max_norm is not None:
        return f"{name} renormalises rows (max_norm)"
    if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm)) and (
            len(m.normalized_shape) != 1 or m.weight is None
            or (isinstance(m, torch.nn.LayerNorm) and m.bias is None)):
        return f"{name} normalises other than the last dim with weight and bias"
    return ""


def _layer(name: str, m: Any, dtype: torch.dtype) -> tuple[Any, dict[str, torch.Tensor]]:
    """The core layer of one recorded module, and the tensors it should read."""
    if isinstance(m, GraphOp):
        core = m._runner.core
        host = {t: host_array(p) for t, p in zip(m.weight_ids(), m.weight_tensors())}
        # the block's weight ids with its name in front of each part: a weight that
        # fusion merged ("q+k+v.weight") is found under the merged id of the big graph
        bound = {"+".join(f"{name}.{p}" for p in t.split("+")): v
                 for t, v in core._bound.items()}
        return Block(name, m.core_source(host)), bound
    w = {k: v.detach() for k, v in m.named_parameters(recurse=False) if v is not None}
    host = {k: host_array(v) for k, v in w.items()}
    if isinstance(m, torch.nn.Embedding):
        layer = OpLayer(name, op="Embedding", kind="embedding", weights=host, x_index=1)
    elif isinstance(m, torch.nn.LayerNorm):
        layer = L.LayerNorm(name, eps=m.eps).load_weights(host)
    elif isinstance(m, torch.nn.RMSNorm):
        eps = m.eps if m.eps is not None else torch.finfo(dtype).eps
        layer = L.RmsNorm(name, eps=eps).load_weights(host)
    else:
        layer = L.Linear(name, out_features=m.out_features, bias=m.bias is not None
                         ).load_weights(host)
    return layer, {f"{name}.{k}": v for k, v in w.items()}


class StepProgram:
    """One core GraphOp for a recorded step; ``program(ids) -> output``."""

    def __init__(self, steps: list, ids: torch.Tensor, dtype: torch.dtype) -> None:
        self.cache = next((c for _, _, c in steps if c is not None), None)
        self.steps, self.key = steps, _key(steps)
        layers, bound = [], {}
        for name, m, _ in steps:
            layer, mine = _layer(name, m, dtype)
            layers.append(layer)
            bound.update(mine)
        op = BoundCore(layers, name="model_step")
        op._ensure_graph([desc_of(ids)])  # lowers and fuses now
        wmap = op.graph.weight_map
        op.rebind({t: v for t, v in bound.items()
                   if t in wmap and tuple(v.shape) == wmap[t].shape
                   and v.dtype == Dtype.of(wmap[t].dtype).torch})
        if self.cache is not None:
            pinned = []
            for _, m, c in steps:
                if c is not None:
                    pinned += cache_layers(m._runner.core, c)
            if any(getattr(l, "kind", "") == "attention" and not getattr(l, "kv_cache", False)
                   for l in flat_layers(layers)):
                raise CapabilityError("compile", "attention without a KV cache in a cached "
                                      "model", "kv_cache=True", "kv_cache=False")
            share_cache_layers(op, self.cache, pinned)
        self.op = op

    def current(self, model: torch.nn.Module) -> bool:
        """Whether the modules still hold what the program was made from (and the
        model still keeps the cache it wrote)."""
        if self.cache is not None and getattr(model, "kv_cache", None) is not self.cache:
            return False
        return _key(self.steps) == self.key

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            return self.op(ids)
        return self.op(ids, kv_cache=self.cache)[0]

    def explain(self) -> str:
        return self.op.explain()


def _key(steps: list) -> tuple:
    """What the program was made from: the modules, the caches and each GraphOp's
    bound weights (a rebind after a parameter changed makes a new dict)."""
    return tuple((id(m), id(c), id(m._runner.core) if isinstance(m, GraphOp) else 0,
                  id(m._runner.core._bound) if isinstance(m, GraphOp) else
                  tuple((p.data_ptr(), p._version) for p in m.parameters()))
                 for _, m, c in steps)
