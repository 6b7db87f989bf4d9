"""apply_point: the seed's Plugin class at named points, in every front-end's tensors."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from atbcore.errors import ParamsError
from atbcore.plugin import POINTS, Plugin, apply_point, get_plugin_manager, hookimpl
from atbcore.plugin.points import POST_POINTS, PRE_POINTS
from atbcore.tensor import framework_of, to_numpy


class Doubler(Plugin):
    """The seed's shape of plugin: preprocess/postprocess over a list of tensors."""

    def preprocess(self, inputs):
        return [x * 2 for x in inputs]

    def postprocess(self, outputs):
        return [x + 1 for x in outputs]


def test_points_are_the_contract():
    assert POINTS == ("pre_attention", "post_attention", "pre_mlp", "post_mlp", "pre_block",
                      "post_block", "model_input", "model_output", "rope")
    # postprocess never runs at a pre point, nor preprocess at a post point
    assert PRE_POINTS == {"pre_attention", "pre_mlp", "pre_block", "model_input"}
    assert POST_POINTS == {"post_attention", "post_mlp", "post_block", "model_output"}


def test_rope_is_not_a_pre_or_post_point(plugin_env):
    with pytest.raises(ParamsError, match="replaces a computation"):
        apply_point("rope", [np.ones(1)], [Doubler()], node="block0")


@pytest.mark.parametrize("point", sorted(PRE_POINTS | POST_POINTS))
def test_preprocess_at_pre_points_postprocess_at_post_points(plugin_env, point):
    x = np.array([[1.0, -3.0]], np.float32)
    (y,) = apply_point(point, [x], [Doubler()])
    pre = point.startswith("pre_") or point == "model_input"
    np.testing.assert_array_equal(y, x * 2 if pre else x + 1)


def test_base_plugin_passes_through_and_none_keeps_inputs(plugin_env):
    x = np.ones((2, 2), np.float32)
    assert apply_point("pre_mlp", [x], [Plugin()])[0] is x

    class InPlace(Plugin):
        def preprocess(self, inputs):
            inputs[0][...] = 7  # writes through, returns nothing
            return None

    (y,) = apply_point("pre_mlp", [x], [InPlace()])
    assert y is x and float(x[0, 0]) == 7.0


def test_single_tensor_return_is_accepted_for_single_input(plugin_env):
    x = np.ones(3, np.float32)
    (y,) = apply_point("post_mlp", [x], [lambda ts: ts[0] * 5])
    np.testing.assert_array_equal(y, np.full(3, 5, np.float32))


def test_unknown_point_is_a_params_error_naming_the_node(plugin_env):
    with pytest.raises(ParamsError, match="block0: unknown plugin point.*'pre_softmax'"):
        apply_point("pre_softmax", [np.ones(1)], [Doubler()], node="block0")


def test_global_hook_receives_point_node_and_tensors(plugin_env):
    seen = []

    class Spy:
        @hookimpl
        def atb_preprocess(self, point, tensors, node):
            seen.append((point, node, len(tensors)))

        @hookimpl
        def atb_postprocess(self, point, tensors, node):
            seen.append((point, node, len(tensors)))
            return [t * 0 for t in tensors]

    get_plugin_manager().register(Spy(), name="spy")
    x = np.ones(2, np.float32)
    assert apply_point("pre_block", [x, x], node="g")[0] is x
    (y,) = apply_point("post_attention", [x], node="g/attn")
    np.testing.assert_array_equal(y, np.zeros(2, np.float32))
    assert seen == [("pre_block", "g", 2), ("post_attention", "g/attn", 1)]


def _framework_tensors():
    out = [("numpy", lambda a: a)]
    if importlib.util.find_spec("torch"):
        out.append(("torch", lambda a: __import__("torch").from_numpy(a)))
    if importlib.util.find_spec("mindspore"):
        out.append(("mindspore", lambda a: __import__("mindspore").Tensor(a)))
    if importlib.util.find_spec("paddle"):
        out.append(("paddle", lambda a: __import__("paddle").to_tensor(a)))
    return out


@pytest.mark.parametrize("framework,make", _framework_tensors(), ids=lambda v: v
                         if isinstance(v, str) else "")
def test_plugins_see_the_front_end_tensors(plugin_env, framework, make):
    seen = []

    class Seer(Plugin):
        def preprocess(self, inputs):
            seen.append(framework_of(inputs[0]))
            return [x * 2 for x in inputs]  # each framework's own arithmetic

    class GlobalSeer:
        @hookimpl
        def atb_preprocess(self, tensors):
            seen.append(framework_of(tensors[0]))
            return [t - 1 for t in tensors]

    get_plugin_manager().register(GlobalSeer(), name="global_seer")
    a = np.array([[1.5, -2.0, 3.0]], np.float32)
    (y,) = apply_point("pre_attention", [make(a)], [Seer()])
    assert framework_of(y) == framework
    assert seen == [framework, framework]
    np.testing.assert_allclose(to_numpy(y), a * 2 - 1)
