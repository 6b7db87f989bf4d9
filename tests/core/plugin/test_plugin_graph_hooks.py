"""Graph-lifecycle hooks: rewrites chain from plugin to plugin, bad ones are named."""

from __future__ import annotations

import numpy as np
import pytest

from atbcore.errors import ParamsError, PluginError
from atbcore.graph.ir import Graph, Node
from atbcore.ops.norm import RmsNormParams
from atbcore.plugin import call_graph_hook, get_plugin_manager, hookimpl
from atbcore.tensor import TensorDesc


def _graph(eps: float = 1e-6) -> Graph:
    w = np.ones(4, np.float32)
    return Graph(name="g", inputs=("x",), outputs=("y",),
                 nodes=(Node("norm", "RmsNorm", RmsNormParams(eps=eps), ("x", "w"), ("y",)),),
                 weights=(("w", w),), descs=(("x", TensorDesc([2, 4], "fp32")),))


def _eps(graph: Graph) -> float:
    return graph.node("norm").params.eps


class EpsRewriter:
    """Multiplies the norm's eps: order shows in the result."""

    def __init__(self, mul: float, **opts) -> None:
        self.mul = mul
        self.seen: list[float] = []

        @hookimpl(specname="atb_graph_after_build", **opts)
        def after_build(graph):
            self.seen.append(_eps(graph))
            n = graph.node("norm")
            node = n.replace(params=RmsNormParams(eps=n.params.eps * self.mul))
            return graph.replace(nodes=(node,))

        self.after_build = after_build


def test_rewrites_chain_through_plugins_in_hook_order(plugin_env):
    pm = get_plugin_manager()
    a, b = EpsRewriter(10.0), EpsRewriter(3.0, tryfirst=True)
    pm.register(a, name="a")
    pm.register(b, name="b")
    g = _graph(eps=1e-6)
    out = call_graph_hook("atb_graph_after_build", g)
    assert b.seen == [1e-6] and a.seen == [pytest.approx(3e-6)]  # b first, a sees b's rewrite
    assert _eps(out) == pytest.approx(3e-5)
    assert _eps(g) == 1e-6  # the input graph is a value: untouched
    # the other lifecycle hook is separate: nothing implements it here
    assert call_graph_hook("before_plan", g) is g


def test_none_keeps_the_graph_and_no_plugins_is_identity(plugin_env):
    class Watcher:
        @hookimpl
        def atb_graph_before_plan(self, graph):
            return None

    g = _graph()
    assert call_graph_hook("atb_graph_before_plan", g) is g
    get_plugin_manager().register(Watcher(), name="watcher")
    assert call_graph_hook("graph_before_plan", g) is g


def test_non_graph_result_is_rejected_with_plugin_named(plugin_env):
    class Liar:
        @hookimpl
        def atb_graph_after_build(self, graph):
            return {"nodes": []}

    get_plugin_manager().register(Liar(), name="liar")
    with pytest.raises(PluginError, match="plugin 'liar': atb_graph_after_build returned a dict"):
        call_graph_hook("after_build", _graph())


def test_raising_graph_hook_is_named(plugin_env):
    class Crash:
        @hookimpl
        def atb_graph_before_plan(self, graph):
            raise AttributeError("no attribute 'foo'")

    get_plugin_manager().register(Crash(), name="crash")
    with pytest.raises(PluginError, match="plugin 'crash': hook atb_graph_before_plan raised "
                                          "AttributeError"):
        call_graph_hook("before_plan", _graph())


def test_rewrite_failing_verification_is_rejected_with_plugin_named(plugin_env):
    class Dangler:
        @hookimpl
        def atb_graph_after_build(self, graph):
            n = graph.node("norm")
            return graph.replace(nodes=(n.replace(inputs=("x", "missing_weight")),))

    get_plugin_manager().register(Dangler(), name="dangler")
    with pytest.raises(PluginError, match="plugin 'dangler'.*fails verification") as ei:
        call_graph_hook("after_build", _graph())
    assert "missing_weight" in str(ei.value)


def test_unknown_graph_hook_name():
    with pytest.raises(ParamsError, match="unknown graph hook"):
        call_graph_hook("atb_graph_after_lunch", _graph())
