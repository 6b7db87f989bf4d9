"""A running GraphOp's plugin points: the typed payloads and the ``rope`` point.

:class:`PointRunner` is the hook a GraphOp hands its plan when plugins are
active (``ExecPlan.run(..., hook=runner)``); the plan calls it before and after
every node that has a point (see :func:`~atbcore.graph.graph_op_explain.plugin_points`).
It converts the node's tensors to the caller's framework, builds the point's
payload (:mod:`atbcore.plugin.payloads`) and runs the plugins:

* ``pre_*`` / ``post_*``: :func:`atbcore.plugin.apply_point` with the payload;
* ``rope`` (RoPE nodes): before the node, the rope plugins rotate q and k
  (:func:`atbcore.plugin.rope_point.apply_rope`); after it, their result
  replaces the node's outputs (when none answered the built-in result stays).

With no plugin active the plan gets no hook and none of this runs.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import numpy as np

from ..errors import AtbError, CapabilityError, PluginError
from ..log import logger
from ..tensor import convert, copy_into, framework_of, from_numpy, to_numpy
from .ir import Graph

__all__ = ["PointRunner", "PointInfo", "ROPE_OPS"]

ROPE_OPS = frozenset({"RoPE", "RopeKVCache"})  # nodes whose params are RoPE's
_FUSED_ROPE = "RopeFlashAttention"
_ROPE_WITH_CACHE = "RopeKVCache"
_ATTENTION = frozenset({"FlashAttention", "PagedAttention", _FUSED_ROPE})
_VIEWS = frozenset({"Reshape"})  # ops a RoPE's output passes through on its way to attention


class PointInfo:
    """What the points need from one (fused) graph: the layer index of each
    (point, node) -- the node's rank among the graph's nodes at that point, in
    graph order -- and the RoPE feeding each attention."""

    def __init__(self, graph: Graph, points: dict[str, tuple[str | None, str | None]]) -> None:
        self.graph = graph
        self.nodes = {n.name: n for n in graph.nodes}
        self.layers: dict[tuple[str, str], int] = {}
        counts: dict[str, int] = {}
        for n in graph.nodes:
            for point in dict.fromkeys(points.get(n.name, ())):
                if point:
                    self.layers[(point, n.name)] = counts.get(point, 0)
                    counts[point] = counts.get(point, 0) + 1
        prod = graph.producers()
        self.rope_of: dict[str, Any] = {}
        for n in graph.nodes:
            if n.op in _ATTENTION and n.inputs:
                src = prod.get(n.inputs[0])
                while src is not None and src.op in _VIEWS:
                    src = prod.get(src.inputs[0])
                if src is not None and src.op in ROPE_OPS:
                    self.rope_of[n.name] = src
        self._inputs: dict[int, tuple[Any, dict[str, tuple[str, ...]]]] = {}


    def call_inputs(self, plan: Any, node: str) -> tuple[str, ...]:
        """Names of the activation inputs (not weights) the plan hands a pre hook
        of ``node``, in that order (per plan, remembered while the plan lives)."""
        hit = self._inputs.get(id(plan))
        if hit is None or hit[0]() is not plan:
            names = {c.node: tuple(n for n, slot, _ in c.ins
                                   if isinstance(slot, str) and slot not in plan.weights_env)
                     for c in plan.calls}
            hit = self._inputs[id(plan)] = (weakref.ref(plan), names)
        return hit[1].get(node, ())


def _heads(x: Any, layout: str, heads: int, head_dim: int) -> Any:
    """``x`` as ``[B, S, heads, head_dim]`` (BSH reshaped, BSND as is, BNSD swapped)."""
    if layout == "BSH":
        return x.reshape((x.shape[0], x.shape[1], heads, head_dim))
    if layout == "BNSD":
        return x.permute(0, 2, 1, 3) if framework_of(x) == "torch" else x.transpose((0, 2, 1, 3))
    return x


def _to_caller(t: Any, framework: str) -> tuple[Any, bool]:
    """``t`` (a plan tensor) as the caller's framework's, and whether that is a
    copy. Paddle crosses by copy both ways (:func:`_to_plan`): a Paddle tensor
    over torch memory that itself wraps Paddle memory (graph inputs and outputs
    do) deadlocks in Paddle's DLPack deleter when it is freed."""
    if framework == "paddle" and framework_of(t) != "paddle":
        return from_numpy(np.array(to_numpy(t), copy=True), framework), True
    return convert(t, framework), False


def _to_plan(t: Any, kind: str) -> Any:
    """A plugin's tensor as the plan's ``kind`` (a copy out of Paddle, see above)."""
    if framework_of(t) == "paddle" and kind != "paddle":
        return from_numpy(np.array(to_numpy(t), copy=True), kind)
    return convert(t, kind)


def _back(outs: list, given: list, copied: list, native: list) -> list:
    """Plugin outputs as the plan's tensors: an input handed back unchanged is the
    plan's own tensor again (a copy the plugin may have written into is copied
    back into it); anything else is converted."""
    res = []
    for o, g, c, n in zip(outs, given, copied, native):
        if o is g:
            if c:
                copy_into(n, o)
            res.append(n)
        else:
            res.append(_to_plan(o, framework_of(n)))
    return res


def _output_heads(o: Any, q: Any, layout: str) -> Any:
    """The attention output as ``[B, S, H, D]`` like the payload's ``q`` (BNSD
    outputs are swapped, BSH and token-major ones reshaped)."""
    if layout == "BNSD":
        return o.permute(0, 2, 1, 3) if framework_of(o) == "torch" else o.transpose((0, 2, 1, 3))
    return o.reshape(tuple(q.shape))


def _positions(past: np.ndarray, seq: int, framework: str) -> Any:
    pos = np.asarray(past, dtype=np.int64).reshape(-1, 1) + np.arange(seq, dtype=np.int64)
    return from_numpy(pos, framework)


class PointRunner:
    """The point hook of one GraphOp call (see the module docstring)."""

    def __init__(self, op: Any, plan: Any, framework: str) -> None:
        self.op, self.plan, self.framework = op, plan, framework
        info = op._point_info
        if info is None or info.graph is not op.graph:
            info = op._point_info = PointInfo(op.graph, op._points)
        self.info = info
        self.form = ("in_place" if op._cache_form is not None else
                     "concatenate" if op._kv is not None and op._kv.slots else "none")
        self._rotated: dict[str, Any] = {}   # RoPE node -> plugin outputs (None: built-in)
        self._attention: dict[str, Any] = {}  # attention node -> its pre_attention payload
        self._layout: dict[str, str] = {}  # attention node -> its q/output layout

    def __call__(self, point: str, node: str, tensors: list) -> list:
        if point == "rope":
            return self._rope(node, tensors)
        from ..plugin import apply_point
        from ..plugin.payloads import CacheState, PointPayload

        fw, copied = map(list, zip(*(_to_caller(t, self.framework) for t in tensors))) \
            if tensors else ([], [])
        where = f"{self.op.name}/{node}" if node else self.op.name
        payload = None
        if point == "pre_attention":
            self._check_unfused(node, where)
            payload = self._attention[node] = self._guarded(self._attention_payload, node, fw)
        elif point == "post_attention" and self._attention.get(node) is not None:
            pre = self._attention.pop(node)
            layout = self._layout.get(node, "BSH")
            payload = self._guarded(lambda _, o: dataclasses.replace(
                pre, point=point, output=_output_heads(o[0], pre.q, layout)), node, fw)
        if payload is None:
            payload = PointPayload(point, where, self.info.layers.get((point, node)),
                                   CacheState(self.form))
        out = apply_point(point, fw, self.op._plugins.get(point, ()), node=where,
                          payload=payload)
        return _back(out, fw, copied, tensors)

    def _guarded(self, build: Any, node: str, fw: list) -> Any:
        """A payload, or None (the plain PointPayload then) for an attention whose
        layout the payload cannot describe: plugins that only read the tensors
        keep working on every graph."""
        try:
            return build(node, fw)
        except (AtbError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            logger.debug("%s/%s: no attention payload (%s)", self.op.name, node, e)
            return None

    def _check_unfused(self, node: str, where: str) -> None:
        from ..plugin.rope_point import rope_plugins_present

        op = self.info.nodes[node].op
        if op in (_FUSED_ROPE, _ROPE_WITH_CACHE) and rope_plugins_present(
                self.op._plugins.get("rope", ())):
            raise PluginError(where, f"a rope plugin was registered after this GraphOp fused "
                              f"RoPE into {op}", "rope plugins registered before the first call "
                              "(or fusion_config={'enable_rope_fusion': False})", op)

    # ------------------------------------------------------------------ rope
    def _rope(self, node: str, tensors: list) -> list:
        if node in self._rotated:  # after the node: the plugin's rotation replaces its outputs
            rotated = self._rotated.pop(node)
            return tensors if rotated is None else rotated
        from ..plugin.rope_point import apply_rope, rope_plugins_present

        local = self.op._plugins.get("rope", ())
        self._rotated[node] = None
        if not rope_plugins_present(local):
            return tensors
        self._check_unfused(node, f"{self.op.name}/{node}")
        payload, kinds, shapes = self._rope_payload(node, tensors)
        if payload is None:
            return tensors
        out = apply_rope(payload, local, node=f"{self.op.name}/{node}")
        if out is not None:
            self._rotated[node] = [None if t is None else _to_plan(t.reshape(s), k)
                                   for t, s, k in zip(out, shapes, kinds)
                                   if s is not None or t is not None]
        return tensors

    def _rope_payload(self, node: str, tensors: list) -> tuple[Any, list, list]:
        from ..plugin.payloads import CacheState, RopePayload

        n = self.info.nodes[node]
        ins = dict(zip(self.info.call_inputs(self.plan, node), tensors))
        if ins.get("cos") is not None:  # the rotation comes from tables, not from parameters
            return None, [], []
        p = n.params
        q, k = ins["q"], ins.get("k")
        layout = p.layout or ("BSH" if len(q.shape) == 3 else "BSND")
        if layout == "BNSD":
            raise CapabilityError(node, "the rope point on a BNSD RoPE", "BSH or BSND q/k",
                                  "BNSD")
        hd = p.head_dim or (q.shape[-1] // p.num_heads if layout == "BSH" else q.shape[-1])
        hq = q.shape[-1] // hd if layout == "BSH" else q.shape[2]
        hk = None if k is None else (k.shape[-1] // hd if layout == "BSH" else k.shape[2])
        kinds = [framework_of(q), None if k is None else framework_of(k)]
        shapes = [tuple(q.shape), None if k is None else tuple(k.shape)]
        q, k = (None if t is None else _to_caller(t, self.framework)[0] for t in (q, k))
        pos = ins.get("position_ids")
        if pos is None:
            positions = _positions(np.array([p.position_offset]), q.shape[1], self.framework)
        else:
            positions = _to_caller(pos, self.framework)[0]
            if len(positions.shape) == 1:
                positions = positions.reshape((1, positions.shape[0]))
        past = tuple(int(v) for v in to_numpy(positions)[:, 0]) if positions.shape[1] else ()
        from ..plugin.payloads import RopeParameters

        rope = RopeParameters(float(p.base), int(p.rotary_dim or hd), int(hd), p.rotary_type,
                              int(hq), hk, int(p.position_offset))
        payload = RopePayload("rope", f"{self.op.name}/{node}", self.info.layers.get(("rope", node)),
                              CacheState(self.form, past), q=_heads(q, layout, hq, hd),
                              k=None if k is None else _heads(k, layout, hk, hd),
                              positions=positions, rope=rope)
        return payload, kinds, shapes

    # ------------------------------------------------------------------ attention
    def _attention_payload(self, node: str, fw: list) -> Any:
        from ..plugin.payloads import AttentionPayload, CacheState

        n = self.info.nodes[node]
        ins = dict(zip(self.info.call_inputs(self.plan, node), fw))
        p = n.params
        where = f"{self.op.name}/{node}"
        layer = self.info.layers.get(("pre_attention", node))
        rope_node = self.info.rope_of.get(node)
        rp = rope_node.params if rope_node is not None else (p if n.op == _FUSED_ROPE else None)
        if n.op == "PagedAttention":
            return self._paged_payload(n, ins, where, layer, rp)
        q, k, v = ins.get("q"), ins.get("k"), ins.get("v")
        h = p.num_heads
        layout = self._layout[node] = p.layout or ("BSH" if len(q.shape) == 3 else "BNSD")
        if k is None:  # packed [B, S, (H + 2 Hkv) * D]
            hkv = p.num_kv_heads or h
            d = q.shape[-1] // (h + 2 * hkv)
            q, k, v = q[..., : h * d], q[..., h * d: (h + hkv) * d], q[..., (h + hkv) * d:]
        d = p.head_dim or (q.shape[-1] // h if layout == "BSH" else q.shape[-1])
        hkv = k.shape[-1] // d if layout == "BSH" else k.shape[1 if layout == "BNSD" else 2]
        q, k, v = _heads(q, layout, h, d), _heads(k, layout, hkv, d), _heads(v, layout, hkv, d)
        b, sq, skv = q.shape[0], q.shape[1], k.shape[1]
        pos = ins.get("position_ids")
        if pos is not None:
            positions = pos.reshape((1, pos.shape[0])) if len(pos.shape) == 1 else pos
        else:
            offset = getattr(p, "position_offset", 0) if n.op == _FUSED_ROPE else 0
            positions = _positions(np.full(b, skv - sq + offset), sq, self.framework)
        past = tuple(int(x) for x in to_numpy(positions)[:, 0]) if sq else ()
        return AttentionPayload("pre_attention", where, layer, CacheState(self.form, past),
                                q=q, k=k, v=v, positions=positions, rope=_rope_params(rp, h, hkv, d))

    def _paged_payload(self, n: Any, ins: dict, where: str, layer: Any, rp: Any) -> Any:
        from ..plugin.payloads import AttentionPayload, CacheState

        q, kc, vc = ins["query"], ins["key_cache"], ins["value_cache"]
        lens = to_numpy(ins["context_lens"]).astype(np.int64).reshape(-1)
        qlens = (to_numpy(ins["q_seq_lens"]).astype(np.int64).reshape(-1)
                 if ins.get("q_seq_lens") is not None else np.ones_like(lens))
        b, t = len(lens), q.shape[0]
        h, d = q.shape[1], q.shape[2]
        equal = (qlens == qlens[0]).all() and int(qlens[0]) * b == t and (lens == lens[0]).all()
        k = v = None
        if equal:
            s = int(qlens[0])
            q = q.reshape((b, s, h, d))
            rows = to_numpy(ins["block_tables"]).reshape(b, -1)
            if rows.shape[1] == 1 and (rows[:, 0] == np.arange(b)).all() \
                    and kc.shape[1] >= int(lens[0]):  # one block per sequence: the cache rows
                k, v = kc[:b, : int(lens[0])], vc[:b, : int(lens[0])]
            positions = _positions(lens - qlens, s, self.framework)
        else:
            q = q.reshape((1, t, h, d))
            positions = from_numpy(np.concatenate([np.arange(a - c, a) for a, c in
                                                   zip(lens, qlens)]).reshape(1, -1),
                                   self.framework)
        cache = CacheState(self.form, tuple(int(x) for x in lens - qlens), kc, vc)
        hkv = kc.shape[-2]
        return AttentionPayload("pre_attention", where, layer, cache, q=q, k=k, v=v,
                                positions=positions, rope=_rope_params(rp, h, hkv, d))


def _rope_params(rp: Any, h: int, hkv: int, d: int) -> Any:
    from ..plugin.payloads import RopeParameters

    if rp is None:
        return None
    return RopeParameters(float(rp.base), int(rp.rotary_dim or d), int(d), rp.rotary_type, int(h),
                          int(hkv), int(getattr(rp, "position_offset", 0)))
