"""Activation ops and the activation registry: torch kernels vs the NumPy reference,
torch.nn.functional and Hugging Face ``transformers.activations`` oracles, plugin-style
registration, bad input."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import atbcore as atb
from atbcore.ops import activation as registry
from oracle import FLOATS, check_error, check_op, rand

SHAPES = [(1, 769), (2, 3, 769), (5, 64)]
ELEMENTWISE = [("Gelu", {}), ("Gelu", {"approximate": "tanh"}), ("QuickGelu", {}), ("SiLU", {}),
               ("Swish", {}), ("Relu", {})]


def run(op, params, inputs):
    return atb.Builder().build_operation(op, params).execute(list(inputs))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op,params", ELEMENTWISE, ids=lambda v: str(v))
def test_elementwise_matches_reference(op, params, shape, dtype):
    check_op(op, params, [rand(shape, dtype, 1, scale=3.0)])


GATED = [("SwiGLU", {}), ("GeGLU", {}), ("GeGLU", {"approximate": "tanh"})]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op,params", GATED, ids=lambda v: str(v))
def test_gated_matches_reference_one_and_two_inputs(op, params, shape, dtype):
    gate, up = rand(shape, dtype, 1, scale=2.0), rand(shape, dtype, 2)
    two = check_op(op, params, [gate, up])[0]
    one = check_op(op, params, [np.concatenate([gate, up], axis=-1)])[0]
    assert one.shape == shape
    np.testing.assert_array_equal(one, two)  # same math either way


def _torch_f32(x):
    return torch.from_numpy(x.astype(np.float32))


@pytest.mark.parametrize("dtype", FLOATS)
def test_vs_torch_functional(dtype):
    x = rand((4, 769), dtype, 3, scale=3.0)
    xf = _torch_f32(x)
    golden = {
        ("Gelu", ()): F.gelu(xf),
        ("Gelu", (("approximate", "tanh"),)): F.gelu(xf, approximate="tanh"),
        ("SiLU", ()): F.silu(xf),
        ("Relu", ()): F.relu(xf),
        ("QuickGelu", ()): xf * torch.sigmoid(1.702 * xf),
    }
    t = torch.from_numpy(x) if dtype == "fp32" else torch.from_numpy(x.astype(np.float32)).to(
        atb.Dtype.of(dtype).torch)
    for (op, params), want in golden.items():
        y, = run(op, dict(params), [t])
        assert y.dtype == t.dtype
        atb.assert_close(y, want, dtype, f"{op}{params} vs torch.nn.functional")
    g, u = t[:, :384], t[:, 384:768]
    y, = run("SwiGLU", {}, [g, u])
    atb.assert_close(y, F.silu(xf[:, :384]) * xf[:, 384:768], dtype, "SwiGLU vs silu(g)*u")
    y, = run("GeGLU", {}, [t[:, :768]])
    atb.assert_close(y, F.gelu(xf[:, :384]) * xf[:, 384:768], dtype, "GeGLU vs gelu(a)*b")


def test_vs_hf_activations():
    from transformers.activations import ACT2FN, GELUActivation, QuickGELUActivation

    x = torch.from_numpy(rand((3, 769), "fp32", 4, scale=4.0))
    cases = [("Gelu", {}, GELUActivation()), ("QuickGelu", {}, QuickGELUActivation()),
             ("Gelu", {"approximate": "tanh"}, ACT2FN["gelu_new"]),
             ("Gelu", {"approximate": "tanh"}, ACT2FN["gelu_pytorch_tanh"]),
             ("SiLU", {}, ACT2FN["silu"]), ("Swish", {}, ACT2FN["swish"]),
             ("Relu", {}, ACT2FN["relu"]), ("QuickGelu", {}, ACT2FN["quick_gelu"])]
    for op, params, hf in cases:
        y, = run(op, params, [x])
        atb.assert_close(y, hf(x), "fp32", f"{op}{params} vs HF {type(hf).__name__}")


@pytest.mark.parametrize("name,op,params", [
    ("gelu", "Gelu", {}), ("gelu_tanh", "Gelu", {"approximate": "tanh"}),
    ("quick_gelu", "QuickGelu", {}), ("silu", "SiLU", {}), ("swish", "SiLU", {}),
    ("relu", "Relu", {}), ("swiglu", "SwiGLU", {}), ("geglu", "GeGLU", {})])
def test_activation_by_name_equals_dedicated_op(name, op, params):
    x = torch.from_numpy(rand((3, 770), "bf16", 5, scale=2.0).astype(np.float32)).bfloat16()
    by_name, = run("Activation", {"activation_type": name.upper()}, [x])
    dedicated, = run(op, params, [x])
    assert torch.equal(by_name, dedicated)
    check_op("Activation", {"activation_type": name}, [x.float().numpy()])


def test_seed_gelu_with_dtype_param():
    """Seed 8.9: build_operation("Gelu", {"dtype": atb.Dtype.FP16}) on fp16 input."""
    x = torch.from_numpy(rand((2, 16, 768), "fp32", 6)).half()
    op = atb.Builder().build_operation("Gelu", {"dtype": atb.Dtype.FP16})
    out = [atb.TensorDesc(shape=list(x.shape), dtype=atb.Dtype.FP16)]
    op.execute([x], out)
    atb.assert_close(out[0], F.gelu(x.float()), "fp16", "seed Gelu")


def test_registered_activation_usable_by_name():
    """A plugin-style registration (elementwise and gated without a pair function)
    reaches Activation and FusedFeedForward by name, torch and NumPy alike."""
    def np_sq(x):
        return np.square(np.maximum(x, 0.0))

    def t_sq(x):
        return torch.square(torch.relu(x))

    def np_reglu(x):
        n = x.shape[-1] // 2
        return np.maximum(x[..., :n], 0.0) * x[..., n:]

    def t_reglu(x):
        a, b = x.chunk(2, dim=-1)
        return torch.relu(a) * b

    registry.register_activation("Test_SqRelu", np_sq, t_sq)
    registry.register_activation("test_reglu", np_reglu, t_reglu, gated=True)
    try:
        assert {"test_sqrelu", "test_reglu"} <= set(registry.list_activations())
        x = rand((3, 769), "fp32", 7)
        y = check_op("Activation", {"activation_type": "test_sqrelu"}, [x])[0]
        np.testing.assert_allclose(y, np.square(np.maximum(x, 0)), rtol=1e-6)
        g, u = rand((3, 769), "fp16", 8), rand((3, 769), "fp16", 9)
        y2 = check_op("Activation", {"activation_type": "test_reglu"}, [g, u])[0]  # concat path
        golden = (np.maximum(g.astype(np.float64), 0) * u.astype(np.float64)).astype(np.float16)
        np.testing.assert_array_equal(y2, golden)
        w = [rand((32, 769), "fp32", 10, 0.05), rand((32, 769), "fp32", 11, 0.05),
             rand((769, 32), "fp32", 12, 0.05)]
        check_op("FusedFeedForward", {"activation_type": "test_reglu"}, [x, *w])
        check_op("FusedFeedForward", {"activation_type": "test_sqrelu"}, [x, w[0], w[2]])
    finally:
        registry.unregister_activation("test_sqrelu")
        registry.unregister_activation("test_reglu")
    check_error("Activation", {"activation_type": "test_sqrelu"}, [], atb.ParamsError,
                "test_sqrelu", build_error=True)


@pytest.fixture
def saved_registry():
    """Restore the activation registry after a test that lets a plugin overwrite names."""
    saved = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


def test_builtin_plugin_activations_reach_the_ops(saved_registry):
    """The built-in activations plugin registers through atb_register_ops; its names
    (relu2, reglu, HF aliases) then work in Activation and FusedFeedForward."""
    from atb_plugins import activations as plugin

    from atbcore.plugin import AtbPluginManager

    pm = AtbPluginManager()
    pm.register(plugin, "atb_activations")
    try:
        assert {"relu2", "reglu", "gelu_pytorch_tanh"} <= set(registry.list_activations())
        x = rand((3, 769), "bf16", 11, scale=2.0)
        y = check_op("Activation", {"activation_type": "squared_relu"}, [x])[0]
        golden = np.square(np.maximum(x.astype(np.float64), 0)).astype(x.dtype)
        atb.assert_close(y, golden, "bf16")
        w = [rand((32, 769), "fp32", 10, 0.05), rand((32, 769), "fp32", 11, 0.05),
             rand((769, 32), "fp32", 12, 0.05)]
        xf = torch.from_numpy(x.astype(np.float32))
        g, u, d = (torch.from_numpy(a) for a in w)
        y, = run("FusedFeedForward", {"activation_type": "reglu"}, [xf, g, u, d])
        atb.assert_close(y, F.linear(F.relu(F.linear(xf, g)) * F.linear(xf, u), d), "fp32", "reglu FFN")
    finally:
        pm.unregister(plugin)


def test_register_activation_rejects_bad_arguments():
    with pytest.raises(atb.ParamsError, match="register_activation"):
        registry.register_activation("", np.abs, torch.abs)
    with pytest.raises(atb.ParamsError, match="torch_fn"):
        registry.register_activation("x2", np.abs, "not callable")


G = rand((2, 8))
BAD = [
    # (op, params, inputs, error, fragments)
    ("Gelu", {}, [G.astype(np.int32)], atb.DtypeError, ["x", "INT32"]),
    ("Relu", {"dtype": "fp16"}, [G], atb.DtypeError, ["FP16", "FP32"]),
    ("SiLU", {}, [G, G], atb.InputError, ["number of inputs"]),
    ("SiLU", {}, [], atb.InputError, ["number of inputs"]),
    ("SwiGLU", {}, [rand((2, 7))], atb.ShapeError, ["even", "7"]),
    ("SwiGLU", {}, [G, rand((2, 9))], atb.ShapeError, ["up", "[2, 8]", "[2, 9]"]),
    ("GeGLU", {}, [G, rand((2, 8), "fp16")], atb.DtypeError, ["up", "FP16"]),
    ("Activation", {"activation_type": "relu"}, [G, G], atb.InputError, ["not gated"]),
    ("Activation", {"activation_type": "swiglu"}, [G, G, G], atb.InputError, ["number of inputs"]),
    ("QuickGelu", {}, [rand((2, 8), "fp32").astype(np.float64)], atb.DtypeError, ["FP64"]),
]


@pytest.mark.parametrize("op,params,inputs,exc,frags", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input(op, params, inputs, exc, frags):
    check_error(op, params, inputs, exc, *frags, outputs=[np.full((2, 8), 3.0, np.float32)])


def test_bad_params():
    check_error("Activation", {"activation_type": "swishy"}, [], atb.ParamsError, "swishy",
                "swiglu", build_error=True)
    check_error("Activation", {}, [], atb.ParamsError, "activation_type", build_error=True)
    check_error("Gelu", {"approximate": "sigmoid"}, [], atb.ParamsError, "approximate",
                build_error=True)
    check_error("SiLU", {"beta": 1.0}, [], atb.ParamsError, "beta", build_error=True)


def test_wrong_outputs_leave_them_untouched():
    check_error("Gelu", {}, [G], atb.InputError, "number of outputs",
                outputs=[np.full((2, 8), 3.0, np.float32), np.full((2, 8), 3.0, np.float32)])
    check_error("SwiGLU", {}, [G], atb.ShapeError, "output", outputs=[np.full((2, 8), 3.0, np.float32)])
    check_error("Gelu", {}, [G], atb.DtypeError, "output", outputs=[np.full((2, 8), 3.0, np.float16)])
