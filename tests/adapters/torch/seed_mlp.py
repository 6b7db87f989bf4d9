"""The seed's MLP GraphOp (LayerNorm, Linear, SiLU, Linear, ResidualAdd) at odd sizes
with seeded weights, and its NumPy float64 reference (the fast-call and native-run
tests share them)."""

import numpy as np
import torch

import atb_torch as atb

HIDDEN, INTER = 40, 72  # odd sizes: panel tails in both matmuls
NAMES = {"layer_norm.weight": "ln_w", "layer_norm.bias": "ln_b", "linear.weight": "w1",
         "linear.bias": "b1", "linear_1.weight": "w2", "linear_1.bias": "b2"}


def seed_mlp(seed=0):
    """``(mlp, weights)``: the GraphOp and its weights by reference name, in float64."""
    g = torch.Generator().manual_seed(seed)
    w = {"ln_w": 1 + 0.1 * torch.randn(HIDDEN, generator=g),
         "ln_b": 0.1 * torch.randn(HIDDEN, generator=g),
         "w1": torch.randn(INTER, HIDDEN, generator=g) * HIDDEN ** -0.5,
         "b1": 0.1 * torch.randn(INTER, generator=g),
         "w2": torch.randn(HIDDEN, INTER, generator=g) * INTER ** -0.5,
         "b2": 0.1 * torch.randn(HIDDEN, generator=g)}
    mlp = atb.GraphOp([atb.LayerNorm(eps=1e-5), atb.Linear(out_features=INTER), atb.SiLU(),
                       atb.Linear(out_features=HIDDEN), atb.ResidualAdd()])
    with torch.no_grad():
        mlp(torch.zeros(1, 1, HIDDEN))
        for name, p in mlp.named_parameters():
            p.copy_(w[next(v for k, v in NAMES.items() if name.endswith(k))])
    return mlp, {k: v.double().numpy() for k, v in w.items()}


def mlp_reference(x, w):
    """The MLP in NumPy float64."""
    x = x.double().numpy()
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    h = (x - mu) / np.sqrt(var + 1e-5) * w["ln_w"] + w["ln_b"]
    u = h @ w["w1"].T + w["b1"]
    return (u / (1 + np.exp(-u))) @ w["w2"].T + w["b2"] + x
