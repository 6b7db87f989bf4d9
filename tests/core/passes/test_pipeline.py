"""The pipeline: config, levels, switches and names, reports, verification between
passes naming the failing pass, plugin hooks and plugin fusion rules."""

from __future__ import annotations

import numpy as np
import pytest

import atbcore as atb
from atbcore.errors import GraphError, ParamsError
from atbcore.graph.ir import Node
from atbcore.passes.pattern import Match, Op, elewise
from atbcore.passes.pipeline import PIPELINE, FusionConfig, enabled_rules, run_pipeline
from atbcore.passes.rewrite import FusionRule, Rewrite
from atbcore.passes.rules import FUSION_RULES, register_fusion_rule, unregister_fusion_rule
from atbcore.plugin import get_plugin_manager, hookimpl, reset_plugin_manager
from graphs import G, N, P, w
from interp import run_graph

H = 8
X = {"x": (2, 3, H)}


@pytest.fixture
def plugins(monkeypatch):
    for var in ("ATB_PLUGINS", "ATB_DISABLE_PLUGINS", "ATB_PLUGINS_STRICT", "ATB_TRACE_PLUGINS"):
        monkeypatch.delenv(var, raising=False)
    reset_plugin_manager()
    yield get_plugin_manager()
    reset_plugin_manager()


def gelu_mlp():
    return G([N("up", "Linear", ["x", "wu"]), N("act", "Gelu", "up"),
              N("down", "Linear", ["act", "wd"])], X, "down",
             {"wu": w(16, H), "wd": w(H, 16, seed=1)})


def test_config_validates_and_accepts_seed_keys():
    assert FusionConfig(fusion_level="AGGRESSIVE").fusion_level == "aggressive"
    with pytest.raises(ParamsError, match="fusion_level"):
        FusionConfig(fusion_level="maximal")
    with pytest.raises(ParamsError, match="enable_qkv_fusion"):
        FusionConfig(enable_qkv_fusion="yes")
    assert FusionConfig(disable="qkv").disable == ("qkv",)


def test_pipeline_order_is_the_visible_list():
    assert [p.name for p in PIPELINE] == ["fold_views", "cse", "dce", "fusion",
                                          "cleanup_fold_views", "cleanup_cse", "cleanup_dce"]
    assert [r.name for r in enabled_rules(FusionConfig())] == [
        r.name for r in FUSION_RULES if r.level == "standard"]
    assert enabled_rules(FusionConfig(fusion_level="conservative")) == []
    agg = [r.name for r in enabled_rules(FusionConfig(fusion_level="aggressive"))]
    assert agg[-1] == "gelu_tanh"
    off = [r.name for r in enabled_rules(FusionConfig(enable_mha_fusion=False, disable=("qkv",)))]
    assert "attention" not in off and "attention_bsh" not in off and "qkv" not in off
    assert "packed_qkv" in off  # its own switch (qkv) is on; only the rule named qkv is off


def test_levels_conservative_standard_aggressive():
    g = gelu_mlp()
    x = np.random.default_rng(0).standard_normal((2, 3, H)).astype(np.float32)
    cons, _ = run_pipeline(g, FusionConfig(fusion_level="conservative", verify=True))
    assert cons == g
    std, _ = run_pipeline(g, FusionConfig(verify=True))
    assert [(n.op, n.params.activation_type) for n in std.nodes] == [("FusedFeedForward", "gelu")]
    agg, reports = run_pipeline(g, FusionConfig(fusion_level="aggressive", verify=True))
    assert [(n.op, n.params.activation_type) for n in agg.nodes] == [
        ("FusedFeedForward", "gelu_tanh")]
    assert next(r for r in reports if r.name == "fuse:gelu_tanh").changed
    ref = run_graph(g, [x])[0]
    atb.assert_close(run_graph(std, [x])[0], ref, "fp32", "standard vs unfused")
    # aggressive documents its own bound: tanh-GELU differs by <= 4.8e-4 before down-proj
    diff = np.abs(run_graph(agg, [x])[0] - ref).max()
    wd = np.abs(g.weight_map["wd"]).sum(axis=1).max()
    assert 0 < diff <= 4.8e-4 * wd


def test_reports_say_what_changed_and_descs_are_attached():
    g = G([N("a", "Elewise", ["x", "x"], elewise_type="add"),
           N("b", "Elewise", ["x", "x"], elewise_type="add"),
           N("y", "Elewise", ["a", "b"], elewise_type="mul")], X, "y")
    out, reports = run_pipeline(g, FusionConfig(verify=True))
    by = {r.name: r for r in reports}
    assert by["cse"].changed and "removed b" in by["cse"].detail
    assert not by["fold_views"].changed and not by["fuse:qkv"].changed
    assert str(by["cse"]).startswith("cse: changed (3 -> 2 nodes")
    assert out.desc_map["y"] == atb.TensorDesc((2, 3, H))


def _neg_to(rewrite_node):
    def rewrite(m: Match):
        n = m["n"]
        return Rewrite(add=(rewrite_node(n),))
    return rewrite


def test_a_rule_that_breaks_the_graph_is_named():
    bad = FusionRule("dangling", None, Op("Elewise", name="n", where=elewise("neg")),
                     _neg_to(lambda n: Node(n.name, "Linear", P("Linear"), (n.inputs[0], "nope"),
                                            n.outputs)))
    g = G([N("y", "Elewise", "x", elewise_type="neg")], X, "y")
    register_fusion_rule(bad)
    try:
        with pytest.raises(GraphError, match=r"pass 'fuse:dangling': produced an invalid graph.*"
                                             r"'nope' has no source"):
            run_pipeline(g, FusionConfig(verify=True))
        with pytest.raises(GraphError, match="result fails verification"):
            run_pipeline(g, FusionConfig(verify=False))
        with pytest.raises(GraphError, match="already registered"):
            register_fusion_rule(bad)
    finally:
        unregister_fusion_rule("dangling")
    assert run_pipeline(g)[0] == g


def test_a_rule_that_raises_is_named():
    def boom(m):
        raise KeyError("oops")

    register_fusion_rule(FusionRule("boom", None, Op("Elewise", name="n"), boom))
    try:
        with pytest.raises(GraphError, match=r"pass 'fuse:boom': failed: KeyError"):
            run_pipeline(G([N("y", "Elewise", "x", elewise_type="neg")], X, "y"))
    finally:
        unregister_fusion_rule("boom")


def test_rules_whose_ops_are_missing_are_skipped():
    register_fusion_rule(FusionRule("needs_op", None, Op("Elewise", name="n"),
                                    lambda m: None, requires=("NoSuchOp",)))
    try:
        assert "needs_op" not in [r.name for r in enabled_rules(FusionConfig())]
    finally:
        unregister_fusion_rule("needs_op")


def test_plugin_graph_hooks_run_before_and_after_the_passes(plugins):
    seen = []

    class Hooks:
        @hookimpl
        def atb_graph_after_build(self, graph):
            # double every muls scalar before fusion
            nodes = tuple(n.replace(params=n.params.replace(scalar=2 * n.params.scalar))
                          if n.op == "Elewise" and n.params.elewise_type == "muls" else n
                          for n in graph.nodes)
            return graph.replace(nodes=nodes)

        @hookimpl
        def atb_graph_before_plan(self, graph):
            seen.append([n.op for n in graph.nodes])
            return None

    plugins.register(Hooks(), name="hooks")
    g = G([N("y", "Elewise", "x", elewise_type="muls", scalar=1.5)], X, "y")
    out, reports = run_pipeline(g)
    assert out.nodes[0].params.scalar == 3.0
    assert seen == [["Elewise"]]
    assert reports[0].name == "plugin:atb_graph_after_build" and reports[0].changed
    assert reports[-1].name == "plugin:atb_graph_before_plan" and not reports[-1].changed


def test_plugin_fusion_rules_run_after_the_built_in_ones(plugins):
    # a plugin fuses neg(neg(x)) into nothing: -(-x) == x exactly
    def cancel(m: Match):
        outer, inner = m["outer"], m["inner"]
        return Rewrite(add=(Node(outer.name, "Elewise", P("Elewise", elewise_type="muls",
                                                          scalar=1.0), (m["x"],), outer.outputs),))

    rule = FusionRule("double_neg", None,
                      Op("Elewise", (Op("Elewise", ("x",), name="inner", where=elewise("neg")),),
                         name="outer", where=elewise("neg")), cancel)

    class Rules:
        @hookimpl
        def atb_register_fusion_rules(self):
            return [rule]

    plugins.register(Rules(), name="rules")
    assert enabled_rules(FusionConfig())[-1] is rule
    g = G([N("a", "Elewise", "x", elewise_type="neg"), N("y", "Elewise", "a", elewise_type="neg")],
          X, "y")
    out, reports = run_pipeline(g, FusionConfig(verify=True))
    assert [n.name for n in out.nodes] == ["y"] and out.nodes[0].params.elewise_type == "muls"
    assert next(r for r in reports if r.name == "fuse:double_neg").changed
    assert run_pipeline(g, FusionConfig(disable=("double_neg",)))[0] == g


def test_a_plugin_returning_something_else_is_named(plugins):
    class Bad:
        @hookimpl
        def atb_register_fusion_rules(self):
            return ["not a rule"]

    plugins.register(Bad(), name="bad")
    with pytest.raises(atb.PluginError, match="fusion rule of type str"):
        run_pipeline(G([N("y", "Elewise", "x", elewise_type="neg")], X, "y"))


def test_graph_op_runs_the_pipeline_with_its_config():
    from atbcore.graph import layers as L
    from atbcore.graph.graph_op import GraphOp

    x = np.random.default_rng(3).standard_normal((2, 3, H)).astype(np.float32)
    ops = {}
    for level in ("conservative", "standard", "aggressive"):
        op = GraphOp([L.Linear(out_features=16, bias=False, seed=1), L.Gelu(),
                      L.Linear(out_features=H, bias=False, seed=2)],
                     fusion_config={"fusion_level": level})
        op(x)
        ops[level] = [n.op for n in op.graph.nodes]
    assert ops == {"conservative": ["Linear", "Gelu", "Linear"],
                   "standard": ["FusedFeedForward"], "aggressive": ["FusedFeedForward"]}
