"""Hook order (tryfirst / trylast / registration) and firstresult semantics."""

from __future__ import annotations

import numpy as np
import pytest

from atbcore.plugin import AtbPluginManager, apply_point, get_plugin_manager, hookimpl
from atbcore.plugin import hookspecs


def _affine(mul: float, add: float, **opts):
    """A plugin whose atb_preprocess maps x -> x * mul + add (order-sensitive)."""

    class Affine:
        @hookimpl(**opts)
        def atb_preprocess(self, tensors):
            return [t * np.float32(mul) + np.float32(add) for t in tensors]

    return Affine()


def test_tryfirst_and_trylast_order_chained_point_hooks(plugin_env):
    pm = get_plugin_manager()
    # registered: last, plain1, first, plain2 -> call order: first, plain2, plain1, last
    pm.register(_affine(1, 100, trylast=True), name="last")
    pm.register(_affine(2, 0), name="plain1")
    pm.register(_affine(1, 3, tryfirst=True), name="first")
    pm.register(_affine(10, 0), name="plain2")
    x = np.array([1.0, -2.0], np.float32)
    (y,) = apply_point("pre_attention", [x])
    expected = (((x + 3) * 10) * 2) + 100
    np.testing.assert_array_equal(y, expected)
    # post points do not run atb_preprocess
    (z,) = apply_point("post_attention", [x])
    np.testing.assert_array_equal(z, x)


def test_local_plugins_run_before_global_hooks_in_registration_order(plugin_env):
    get_plugin_manager().register(_affine(3, 0), name="global")
    calls = []

    def local(tag, add):
        def fn(ts):
            calls.append(tag)
            return [t + np.float32(add) for t in ts]
        fn.__name__ = tag
        return fn

    x = np.zeros(3, np.float32)
    (y,) = apply_point("model_input", [x], [local("a", 1), local("b", 2)])
    np.testing.assert_array_equal(y, np.full(3, 9, np.float32))  # (0 + 1 + 2) * 3
    assert calls == ["a", "b"]


def test_firstresult_stops_at_first_answer_in_priority_order():
    pm = AtbPluginManager()
    called = []

    def provider(tag, answer, **opts):
        class P:
            @hookimpl(**opts)
            def atb_activation(self, name):
                called.append(tag)
                return answer

        return P()

    pm.register(provider("builtin", "builtin-gelu", trylast=True), name="builtin")
    pm.register(provider("third", None), name="third")           # passes
    pm.register(provider("override", "override-gelu"), name="override")
    assert pm.hook.atb_activation(name="gelu") == "override-gelu"
    assert called == ["override"]  # later registration first, nothing after the answer
    called.clear()
    pm.unregister(name="override")
    assert pm.hook.atb_activation(name="gelu") == "builtin-gelu"
    assert called == ["third", "builtin"]  # a None answer falls through to trylast
    called.clear()
    pm.register(provider("first", "first-gelu", tryfirst=True), name="first")
    pm.register(provider("newer", "newer-gelu"), name="newer")
    assert pm.hook.atb_activation(name="gelu") == "first-gelu"  # tryfirst beats newer
    assert called == ["first"]


def test_non_firstresult_hooks_collect_every_answer():
    pm = AtbPluginManager()

    def rules(*names):
        class R:
            @hookimpl
            def atb_register_fusion_rules(self):
                return list(names)

        return R()

    pm.register(rules("a"), name="ra")
    pm.register(rules("b", "c"), name="rb")
    assert pm.hook.atb_register_fusion_rules() == [["b", "c"], ["a"]]


def test_hookspecs_are_prefixed_documented_and_firstresult_where_one_answer():
    pm = AtbPluginManager()
    names = [n for n in dir(hookspecs) if n.startswith("atb_")]
    assert sorted(names) == sorted(hookspecs.__all__)
    for n in names:
        caller = getattr(pm.hook, n)
        assert caller.spec is not None and (getattr(hookspecs, n).__doc__ or "").strip(), n
    first = {n for n in names if getattr(pm.hook, n).spec.opts["firstresult"]}
    assert first == {"atb_activation", "atb_rope_frequencies", "atb_model_architecture", "atb_rope"}
    required = {"atb_register_ops", "atb_register_backends", "atb_register_fusion_rules",
                "atb_register_adapters", "atb_graph_after_build", "atb_graph_before_plan",
                "atb_preprocess", "atb_postprocess"}
    assert required <= set(names)


def test_hooks_are_called_with_keywords_only():
    pm = AtbPluginManager()
    with pytest.raises(TypeError):
        pm.hook.atb_activation("gelu")
