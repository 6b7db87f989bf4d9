"""Paddle kernels for Argmax and TopkToppSampling.

Sampling follows :mod:`atbcore.ops.sampling` step for step in float64 (descending
stable order, top-k, top-p, inverse CDF against one uniform per row drawn through
NumPy from the seed), so every backend picks the same ids."""

from __future__ import annotations

import paddle

from atbcore.ops.sampling import sampling_uniforms

from . import kernel

__all__: list[str] = []


def _f64(x):
    # exact for every input dtype (ties stay ties); bf16/fp16 via fp32
    if x.dtype in (paddle.float16, paddle.bfloat16):
        x = x.astype("float32")
    return x.astype("float64")


@kernel("Argmax", impl="paddle.argmax (on float64 values)")
def argmax(p, ins):
    x = ins["x"]
    return [paddle.argmax(_f64(x), axis=p.dim, keepdim=p.keepdim).astype("int64")]


def _sample_sorted(sl, u, p):
    # sl: [B, V] float64 logits / temperature, sorted descending
    e = paddle.exp(sl - sl[:, :1])
    probs = e / e.sum(axis=-1, keepdim=True)
    v = probs.shape[-1]
    keep = paddle.ones(probs.shape, dtype="bool")
    zero = paddle.zeros([], dtype="float64")
    if p.top_k:
        keep = paddle.arange(v).unsqueeze(0).expand(probs.shape) < min(p.top_k, v)
        probs = paddle.where(keep, probs, zero)
        probs = probs / probs.sum(axis=-1, keepdim=True)
    if p.top_p < 1.0:
        c = paddle.cumsum(probs, axis=-1)
        before = paddle.concat([paddle.zeros_like(c[:, :1]), c[:, :-1]], axis=-1)
        keep = keep & (before < p.top_p)
        probs = paddle.where(keep, probs, zero)
    c = paddle.cumsum(probs, axis=-1)
    c = c / c[:, -1:]
    return (c <= u.unsqueeze(1)).astype("int64").sum(axis=-1)


@kernel("TopkToppSampling", impl="paddle argsort + cumsum inverse-CDF sampling (float64)",
        launches=8)
def topk_topp_sampling(p, ins):
    x = ins["logits"]
    if p.temperature == 0.0:
        return [paddle.argmax(_f64(x), axis=-1).astype("int64")]
    x = _f64(x) / p.temperature
    order = paddle.argsort(-x, axis=-1, stable=True)              # descending, ties by index
    sl = paddle.take_along_axis(x, order, axis=-1)
    u = paddle.to_tensor(sampling_uniforms(p.seed, x.shape[0]), dtype="float64", place=x.place)
    pos = _sample_sorted(sl, u, p)
    return [paddle.take_along_axis(order, pos.unsqueeze(1), axis=-1)[:, 0].astype("int64")]
