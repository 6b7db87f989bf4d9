"""Graph-lifecycle hooks: plugins that rewrite a graph, one at a time, verified.

The pass pipeline calls ``call_graph_hook("atb_graph_after_build", g)`` before
the passes and ``call_graph_hook("atb_graph_before_plan", g)`` after them.
"""

from __future__ import annotations

from typing import Any

from ..errors import AtbError, ParamsError
from .isolation import plugin_error
from .manager import get_plugin_manager

__all__ = ["GRAPH_HOOKS", "call_graph_hook"]

GRAPH_HOOKS = ("atb_graph_after_build", "atb_graph_before_plan")


def call_graph_hook(name: str, graph: Any) -> Any:
    """Run graph hook ``name`` (``atb_graph_after_build`` or
    ``atb_graph_before_plan``; the ``atb_`` / ``graph_`` prefix may be left out)
    and return the resulting graph.

    Each plugin sees the previous plugin's graph and may return a rewritten
    ``Graph`` or ``None`` (keep). A rewrite is verified before it is accepted; a
    non-Graph value or a rewrite that fails verification raises PluginError
    naming the plugin."""
    from ..graph.ir import Graph
    from ..graph.verify import verify

    hook = name if name.startswith("atb_") else (
        f"atb_{name}" if name.startswith("graph_") else f"atb_graph_{name}")
    if hook not in GRAPH_HOOKS:
        raise ParamsError("call_graph_hook", "unknown graph hook", list(GRAPH_HOOKS), name)
    current = graph
    pm = get_plugin_manager()
    for plugin, obj in pm.plugins_in_call_order(hook):
        for result in pm.call_plugin(hook, obj, graph=current):
            if result is None:
                continue
            if not isinstance(result, Graph):
                raise plugin_error(plugin, f"{hook} returned a {type(result).__name__}",
                                   "a Graph or None", type(result).__name__, hook=hook)
            try:
                verify(result)
            except AtbError as e:
                raise plugin_error(plugin, f"{hook} returned a graph that fails verification: {e}",
                                   hook=hook) from e
            current = result
    return current
