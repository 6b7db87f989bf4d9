"""Built-in activations by name vs Hugging Face ACT2FN and torch.nn.functional."""

from __future__ import annotations

import numpy as np
import pytest

from atbcore.numerics import assert_close
from atbcore.plugin import get_plugin_manager, resolve_activation

torch = pytest.importorskip("torch")
F = torch.nn.functional
from transformers.activations import ACT2FN  # noqa: E402

from atb_plugins import activations  # noqa: E402
from oracle import rand  # noqa: E402

# our name -> Hugging Face ACT2FN name (the independent oracle)
HF_NAMES = {"gelu": "gelu", "gelu_tanh": "gelu_new", "quick_gelu": "quick_gelu",
            "gelu_10": "gelu_10", "relu2": "relu2"}
# gated name -> torch oracle on (gate, up)
GATED = {"geglu": lambda a, b: F.gelu(a) * b,
         "geglu_tanh": lambda a, b: F.gelu(a, approximate="tanh") * b,
         "reglu": lambda a, b: F.relu(a) * b}


def _x(shape=(3, 40), seed=0, scale=4.0) -> np.ndarray:
    # wide range so the clipped / squared / tail regions are all exercised
    return rand(shape, "fp32", seed, scale=scale).astype(np.float64)


@pytest.mark.parametrize("name", sorted(HF_NAMES))
def test_numpy_reference_matches_hugging_face(name):
    x = _x()
    x[0, :3] = [-30.0, 0.0, 30.0]  # gelu_10 clips at +-10
    ours = activations.ACTIVATIONS[name].numpy_fn(x)
    hf = ACT2FN[HF_NAMES[name]](torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(ours, hf, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(GATED))
def test_gated_variants_match_torch(name):
    x = _x((2, 3, 16))
    a, b = torch.from_numpy(x).chunk(2, dim=-1)
    ours = activations.ACTIVATIONS[name].numpy_fn(x)
    assert ours.shape == (2, 3, 8) and activations.ACTIVATIONS[name].gated
    np.testing.assert_allclose(ours, GATED[name](a, b).numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(activations.ACTIVATIONS))
def test_torch_implementation_matches_reference(name, dtype):
    spec = activations.ACTIVATIONS[name]
    x = rand((4, 32), dtype, seed=1, scale=3.0)
    from atbcore.tensor import to_torch

    got = spec.torch_fn(to_torch(np.array(x, copy=True)))
    assert got.dtype == to_torch(x).dtype
    golden = spec.numpy_fn(x.astype(np.float64)).astype(x.dtype)
    assert_close(got, golden, dtype, what=f"{name} torch vs numpy")


def test_aliases_and_case():
    for alias, target in activations.ALIASES.items():
        assert activations.lookup(alias) is activations.ACTIVATIONS[target]
    assert activations.lookup("GELU_New").name == "gelu_tanh"
    assert activations.lookup("not_an_activation") is None


def test_selectable_by_name_through_the_entry_point_hook(builtins):
    pm = get_plugin_manager()
    assert pm.records["atb_activations"].status == "loaded"
    spec = resolve_activation("squared_relu")
    assert spec.name == "relu2"
    np.testing.assert_array_equal(spec(np.array([-2.0, 3.0])), [0.0, 9.0])
    assert pm.hook.atb_activation(name="swishy-unknown") is None


@pytest.mark.parametrize("name,hf", [("relu2", "relu2"), ("gelu_10", "gelu_10"),
                                     ("gelu_new", "gelu_new"), ("reglu", None)])
def test_core_activation_op_selects_plugin_activations_by_name(builtins, name, hf):
    import atbcore as atb
    from atbcore.ops import activation as registry

    added = {"relu2", "squared_relu", "relu_squared", "gelu_10", "reglu", "gelu_new"}
    for n in added:  # the registry is process-wide: start from the core's own entries
        registry.unregister_activation(n)
    assert not added & set(registry.list_activations())
    get_plugin_manager()  # loading the entry points runs atb_register_ops
    assert {"relu2", "squared_relu", "gelu_10", "reglu", "gelu_new"} <= set(
        registry.list_activations())
    # the core's own entries are extended, not replaced
    assert registry.get_activation("geglu").numpy_pair is not None
    x = rand((3, 16), "fp32", seed=5, scale=6.0)
    if hf is None:
        a, b = torch.from_numpy(x).double().chunk(2, dim=-1)
        oracle = (F.relu(a) * b).numpy()
    else:
        oracle = ACT2FN[hf](torch.from_numpy(x).double()).numpy()
    for backend, data in (("numpy", x), ("torch", torch.from_numpy(x.copy()))):
        op = atb.Builder(backend=backend).build_operation("Activation",
                                                          {"activation_type": name})
        (y,) = op.execute([data])
        assert_close(y, oracle.astype(np.float32), "fp32", what=f"Activation({name}) {backend}")
