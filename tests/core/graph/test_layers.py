"""Seed-style layers: lazy weights initialised like torch, accessors, loading a
framework's parameters, and parameter/shape errors naming the layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import atbcore as atb
from atbcore.errors import ParamsError, ShapeError
from atbcore.graph import layers as L
from atbcore.graph.sequential import lower_sequential
from interp import run_graph

D = atb.TensorDesc


def lower(layers, shape=(2, 5, 16), dtype="fp32"):
    return lower_sequential(layers, [D(shape, dtype)], "t")


def test_linear_infers_in_features_and_initialises_like_nn_linear():
    lin = L.Linear(out_features=256)
    assert lin.weights() == {} and lin.in_features is None
    lower([lin], (2, 5, 64))
    w, b = lin.weights()["weight"], lin.weights()["bias"]
    assert lin.in_features == 64 and w.shape == (256, 64) and b.shape == (256,)
    bound = 1 / np.sqrt(64)  # kaiming_uniform(a=sqrt(5)) as nn.Linear: U(-1/sqrt(in), 1/sqrt(in))
    ref = torch.nn.Linear(64, 256)
    for ours, theirs in ((w, ref.weight), (b, ref.bias)):
        theirs = theirs.detach().numpy()
        assert np.abs(ours).max() <= bound and np.abs(theirs).max() <= bound
        # same distribution: uniform on the same interval (std = bound / sqrt(3))
        assert ours.std() == pytest.approx(bound / np.sqrt(3), rel=0.1)
        assert theirs.std() == pytest.approx(ours.std(), rel=0.15)
    # seeded: same name -> same weights; another name or seed -> others
    again = L.Linear(out_features=256)
    lower([again], (2, 5, 64))
    np.testing.assert_array_equal(again.weights()["weight"], w)
    other = L.Linear("other", out_features=256)
    lower([other], (2, 5, 64))
    assert not np.array_equal(other.weights()["weight"], w)
    seeded = [L.Linear(out_features=8, seed=7) for _ in range(2)]
    lower([seeded[0]]), lower([seeded[1]])
    np.testing.assert_array_equal(seeded[0].weights()["weight"], seeded[1].weights()["weight"])


def test_norm_weights_are_ones_and_zeros():
    ln, rms = L.LayerNorm(eps=1e-5), L.RmsNorm(eps=1e-6)
    lower([ln, rms])
    np.testing.assert_array_equal(ln.weights()["weight"], np.ones(16))
    np.testing.assert_array_equal(ln.weights()["bias"], np.zeros(16))
    np.testing.assert_array_equal(rms.weights()["weight"], np.ones(16))
    assert L.LayerNorm(elementwise_affine=False).weights() == {}


def test_loading_torch_parameters_reproduces_the_modules():
    torch.manual_seed(0)
    ln, fc = torch.nn.LayerNorm(16, eps=1e-5), torch.nn.Linear(16, 24)
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_()
    layers = [L.LayerNorm(eps=1e-5).load_weights(dict(ln.named_parameters())),
              L.Linear(out_features=24).load_weights(dict(fc.named_parameters())), L.SiLU()]
    assert layers[1].in_features == 16
    g = lower(layers)
    x = torch.randn(2, 5, 16)
    gold = torch.nn.functional.silu(fc(ln(x))).detach()
    atb.assert_close(run_graph(g, [x.numpy()])[0], gold, "fp32", "layers vs torch modules")
    assert np.shares_memory(layers[1].weights()["weight"], fc.weight.detach().numpy())


def test_half_inputs_get_half_weights():
    lin = L.Linear(out_features=4)
    g = lower([lin], dtype="fp16")
    assert g.weight_map["linear.weight"].dtype == np.float16
    assert lin.weights()["weight"].dtype == np.float32  # the master copy stays fp32


def test_errors_name_the_layer():
    with pytest.raises(ParamsError, match="out_features"):
        L.Linear(out_features=0)
    with pytest.raises(ParamsError, match="num_kv_heads must divide"):
        L.FlashAttention(num_heads=3, num_kv_heads=2)
    with pytest.raises(ParamsError, match="unknown activation"):
        L.FusedFeedForward(intermediate_size=8, activation_type="nope")
    with pytest.raises(ParamsError, match="layer name"):
        L.SiLU(3)
    lin = L.Linear("proj", out_features=4)
    with pytest.raises(ParamsError, match="proj: unknown weight 'kernel'"):
        lin.load_weights({"kernel": np.zeros((4, 16), np.float32)})
    with pytest.raises(ShapeError, match="proj: weight 'bias' shape"):
        lin.load_weights({"bias": np.zeros(5, np.float32)})
    lin.load_weights({"weight": np.zeros((4, 16), np.float32)})
    with pytest.raises(ShapeError, match="proj: input last dim"):
        lower([lin], (2, 5, 8))
    with pytest.raises(ParamsError, match="layer 1"):
        lower_sequential([L.SiLU(), "relu"], [D((2, 3))])
