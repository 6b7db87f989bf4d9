"""GraphOp helpers kept apart from the class: where plugin points sit in a graph,
and the text of ``GraphOp.explain()``."""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from ..errors import GraphError, ParamsError
from .ir import Graph, Node

__all__ = ["plugin_points", "explain_text", "ATTENTION_OPS", "FFN_OPS", "ACTIVATION_OPS",
           "ROPE_NODES", "FUSED_ROPE_OPS",
           "GraphOpPlugins", "GraphOpViews"]

ATTENTION_OPS = frozenset({"FlashAttention", "PagedAttention", "RopeFlashAttention"})
FFN_OPS = frozenset({"FusedFeedForward", "MoE"})
ACTIVATION_OPS = frozenset({"SiLU", "Gelu", "QuickGelu", "Relu", "SwiGLU", "GeGLU",
                            "Activation"})
_LINEAR_OPS = frozenset({"Linear"})
#: nodes that rotate q and k: RoPE, and RoPE fused with the cache write (the rope point
#: refuses a late rope plugin there) or into the attention (which has its own points)
ROPE_NODES = frozenset({"RoPE", "RopeKVCache"})
FUSED_ROPE_OPS = frozenset({"RopeFlashAttention", "RopeKVCache"})


def plugin_points(graph: Graph) -> dict[str, tuple[str | None, str | None]]:
    """Node name -> (pre point, post point) per the rules in ``graph_op``'s docstring."""
    pts: dict[str, list[str | None]] = {}

    def put(node: str, pre: str | None = None, post: str | None = None) -> None:
        cur = pts.setdefault(node, [None, None])
        if pre and cur[0] is None:
            cur[0] = pre
        if post:
            cur[1] = post

    for n in graph.nodes:
        if n.op in ATTENTION_OPS:
            put(n.name, "pre_attention", "post_attention")
        elif n.op in ROPE_NODES:  # rope plugins rotate before it; their result stands after
            put(n.name, "rope", "rope")
        elif n.op in FFN_OPS:
            put(n.name, "pre_mlp", "post_mlp")
    if not any(n.op in FFN_OPS for n in graph.nodes):
        span = _mlp_span(graph)
        if span is not None:
            put(span[0].name, pre="pre_mlp")
            put(span[1].name, post="post_mlp")
    return {k: (v[0], v[1]) for k, v in pts.items()}


def _mlp_span(graph: Graph) -> tuple[Node, Node] | None:
    prod = graph.producers()
    cons = graph.consumers()
    for act in graph.nodes:
        if act.op not in ACTIVATION_OPS:
            continue
        firsts = [prod[t] for t in act.inputs if t in prod and prod[t].op in _LINEAR_OPS]
        if not firsts:
            continue
        # The last Linear reachable downstream of the activation, in graph order.
        seen, stack, last = set(), [act], None
        while stack:
            n = stack.pop()
            for t in n.outputs:
                for c in cons.get(t, []):
                    if c.name not in seen:
                        seen.add(c.name)
                        stack.append(c)
        order = {n.name: i for i, n in enumerate(graph.nodes)}
        lins = [graph.node(s) for s in seen if graph.node(s).op in _LINEAR_OPS]
        if lins:
            last = max(lins, key=lambda n: order[n.name])
            first = min(firsts, key=lambda n: order[n.name])
            return first, last
    return None


def _node_line(n: Node) -> str:
    ins = ", ".join(t or "-" for t in n.inputs)
    return f"  {n.name}: {n.op}({ins}) -> {', '.join(n.outputs)}"


def explain_text(op: Any) -> str:
    """The report ``GraphOp.explain()`` returns."""
    cfg = op.fusion_config
    lines = [f"GraphOp {op.name!r}  fusion_level={getattr(cfg, 'fusion_level', '?')}"]
    if op.graph is None:
        lines.append("  not built yet: call it once, or explain(*inputs) with tensors or "
                     "TensorDescs")
        return "\n".join(lines)
    before, after = op.graph_unfused, op.graph
    lines.append(f"Before fusion: {len(before.nodes)} nodes")
    lines += [_node_line(n) for n in before.nodes]
    lines.append("Passes:")
    quiet = []
    for r in op.pass_reports:
        name = getattr(r, "name", str(r))
        detail = getattr(r, "detail", "")
        if getattr(r, "changed", False):
            lines.append(f"  {name}: changed" + (f" ({detail})" if detail else ""))
        elif name.startswith("device:"):  # a rule the inputs' device keeps off
            lines.append(f"  {name}: {detail}")
        else:
            quiet.append(name)
    if quiet:
        lines.append(f"  no change: {', '.join(quiet)}")
    lines.append(f"After fusion: {len(after.nodes)} nodes")
    lines += [_node_line(n) for n in after.nodes]
    from ..passes.layout import weight_table

    table = weight_table(after)
    totals: dict[str, int] = {}
    for _, layout, nbytes in table:
        kind = layout.split(" (")[0]
        totals[kind] = totals.get(kind, 0) + nbytes
    lines.append(f"Weights: {len(table)}, {sum(totals.values())} B (" + "; ".join(
        f"{k}: {v} B" for k, v in totals.items()) + ")")
    lines += [f"  {tid}: {layout}, {nbytes} B" for tid, layout, nbytes in table]
    plan = op.last_plan
    if plan is None:
        lines.append("No plan yet (no call so far).")
    else:
        sig = ", ".join(f"{i}: {list(plan.descs[i].shape)} {plan.descs[i].dtype.name}"
                        for i in plan.graph.inputs)
        lines.append(f"Plan for {{{sig}}} on {plan.device} "
                     f"({len(plan.levels)} levels, streams={plan.num_streams}):")
        for row in plan.nodes_table():
            how = {True: "bound once", False: "called per run", None: "not bound yet"}
            ws = f", workspace {row['workspace']} B" if row["workspace"] else ""
            lines.append(f"  {row['node']}: {row['op']} -> {row['backend']} "
                         f"[{row['kernel']}] launches={row['launches']} "
                         f"({how[row['bound']]}{ws})")
            for w, layout in row["layouts"].items():
                lines.append(f"      weight {w}: {layout}")
            for fb in row["fallbacks"]:
                lines.append(f"      fell back past {fb}")
        lines.append(f"Launches per run: {plan.launches}"
                     + (f" (last run: {op.last_launches}, CUDA graph replay)"
                        if op.last_launches is not None and op.last_launches != plan.launches
                        else ""))
        m = plan.memory
        lines.append(f"Memory: arena {m.arena_bytes} B for {len(m.offsets)} intermediates "
                     f"totalling {m.total_intermediate_bytes} B (reuse x{m.reuse_ratio:.2f}); "
                     f"{plan.arena_note}")
    st = op.cache_stats()
    lines.append(f"Plan cache: {st['hits']} hits, {st['misses']} misses, {st['plans']} plans")
    if op._cache is not None and op._cache.declared:
        lines.append(f"Dynamic dims: {op._cache.declared}")
    pts = {k: v for k, v in op._points.items()}
    if pts:
        lines.append("Plugin points: " + ", ".join(
            f"{n}[{'/'.join(p for p in v if p)}]" for n, v in pts.items()))
    regs = {p: len(v) for p, v in op._plugins.items() if v}
    if regs:
        lines.append(f"Plugins registered: {regs}")
    return "\n".join(lines)


def _plugin_manager() -> Any:
    """``atbcore.plugin.get_plugin_manager`` (imported on first use: plugins load
    lazily, and an import statement per call costs more than the call)."""
    global _GET_PM
    if _GET_PM is None:
        from ..plugin import get_plugin_manager

        _GET_PM = get_plugin_manager
    return _GET_PM


_GET_PM: Any = None


class GraphOpPlugins:
    """GraphOp's plugin points (a mixin: state lives in the GraphOp)."""

    def register_plugin(self, point: str, plugin: Any) -> Any:
        """Run ``plugin`` at ``point`` (one of ``atbcore.plugin.POINTS``): a
        :class:`~atbcore.plugin.Plugin` at the pre/post points, an object with
        ``rope(payload)`` (or a callable) at ``rope``."""
        from ..plugin import POINTS

        if point not in POINTS:
            raise ParamsError(self.name, "plugin point", list(POINTS), repr(point))
        self._plugins.setdefault(point, []).append(plugin)
        self._captured.clear()  # a captured graph cannot run Python plugins
        if point == "rope":
            self._unfuse_rope()
        return self

    def _plugins_active(self) -> bool:
        if any(self._plugins.values()):
            return True
        try:
            return _plugin_manager()().execution_hooks_active()
        except (ImportError, NotImplementedError, AttributeError):
            return False

    def _hook(self, framework: str, plan: Any) -> Any:
        from .graph_op_points import PointRunner

        return PointRunner(self, plan, framework)

    def _fusion_for_plugins(self, descs: Sequence[Any] = ()) -> Any:
        """The fusion config to build with: RoPE stays its own node (not fused
        into the attention) while a rope plugin is present, so the plugin rotates;
        the rules the inputs' device keeps off are off
        (:mod:`atbcore.backends.fusion_choices`)."""
        import dataclasses

        from ..plugin.rope_point import rope_plugins_present

        cfg = self.fusion_config
        if getattr(cfg, "enable_rope_fusion", False) and rope_plugins_present(
                self._plugins.get("rope", ())):
            cfg = dataclasses.replace(cfg, enable_rope_fusion=False)
        off = self._device_unfused(descs)
        if off and hasattr(cfg, "disable"):
            cfg = dataclasses.replace(cfg, disable=tuple(dict.fromkeys((*cfg.disable, *off))))
        return cfg

    @staticmethod
    def _device_unfused(descs: Sequence[Any]) -> dict[str, str]:
        """The fusion rules the device of ``descs`` keeps off, with reasons."""
        from ..backends.fusion_choices import unfused_rules
        from ..backends.npu import kernel_device

        dev = next((str(d.device).split(":")[0] for d in descs if hasattr(d, "device")), None)
        return unfused_rules(kernel_device(dev)) if dev else {}

    def _unfuse_rope(self) -> None:
        # a rope plugin arrived after RoPE was fused (here or in the in-place cache form)
        forms = [self.graph] + ([self._in_place.graph] if self._in_place else [])
        if not any(g is not None and any(n.op in FUSED_ROPE_OPS for n in g.nodes) for g in forms):
            return
        with self._lock:
            # concatenations and packs of the old values must not serve the re-lowering
            self._weight_memo.clear()
            if self._in_place:
                self._in_place.destroy()
            if self._cache is not None:
                self._cache.clear()
            self._reset_state()


class GraphOpViews:
    """GraphOp's introspection and drawing (a mixin: state lives in the GraphOp)."""

    @property
    def memory_plan(self) -> Any:
        """The memory plan of the last plan run (None before the first call)."""
        return self.last_plan.memory if self.last_plan is not None else None

    def cache_stats(self) -> dict[str, int]:
        """Plan-cache hits, misses, plans held, evictions, exact signatures seen."""
        return self._cache.stats() if self._cache else {"hits": 0, "misses": 0, "plans": 0,
                                                        "evictions": 0, "signatures": 0}

    def set_dynamic_shape(self, ranges: Mapping[str, Any]) -> None:
        """Declare dynamic dim ranges (see :mod:`atbcore.runtime.plan_cache`)."""
        self._dynamic = dict(ranges)
        with self._lock:
            if self._cache is not None:
                self._cache.set_dynamic_shape(ranges)
                self._captured.clear()

    def explain(self, *inputs: Any) -> str:
        """Nodes before and after fusion, pass reports, per node the kernel and
        backend with fallback reasons, launches, arena size and plan-cache stats.
        Give inputs (tensors or descriptors) to explain the plan for them."""
        if inputs:
            self.plan_for(list(inputs))
        return explain_text(self)

    def export_trace(self, path: str | os.PathLike) -> str:
        """Write the per-node profile as Chrome trace JSON (``profile=True`` runs)."""
        return self.profiler.export_chrome_trace(path)

    def _graphs(self, which: str) -> Graph:
        if which in ("after", "fused"):
            g = self.graph
        elif which in ("before", "unfused"):
            g = self.graph_unfused
        else:
            raise ParamsError(self.name, "which graph", "before/after", repr(which))
        if g is None:
            raise GraphError(self.name, "graph not built yet",
                             "a first call (or explain(inputs)) before drawing", "no graph")
        return g

    def to_dot(self, which: str = "after") -> str:
        """Graphviz DOT of the graph ``"before"`` or ``"after"`` fusion."""
        from .draw import to_dot

        return to_dot(self._graphs(which))

    def to_mermaid(self, which: str = "after") -> str:
        """Mermaid flowchart of the graph ``"before"`` or ``"after"`` fusion."""
        from .draw import to_mermaid

        return to_mermaid(self._graphs(which))

    def render_png(self, path: str | os.PathLike, which: str = "after") -> str:
        """Render the graph as PNG with Graphviz (CapabilityError where it is missing)."""
        from .draw import render_png

        return render_png(self._graphs(which), path)
