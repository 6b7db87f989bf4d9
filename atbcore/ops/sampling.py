"""Token selection: Argmax and TopkToppSampling.

TopkToppSampling is deterministic for a seed and identical on every backend:

1. one uniform ``u`` per row from ``numpy.random.default_rng(seed).random(B)``
   (both backends draw it through NumPy, so they share it);
2. ``logits / temperature`` in float64, candidates sorted by descending logit
   (stable: ties keep index order), softmax;
3. top-k keeps the first ``top_k`` candidates (0 = off), renormalised;
4. top-p keeps the smallest prefix whose cumulative probability is ``>= top_p``;
5. the kept probabilities' cumulative sum is renormalised to end at exactly 1 and
   the first candidate whose cumsum exceeds ``u`` is the sampled id.

``temperature == 0`` is greedy (argmax, first maximum).

Non-finite logits follow one rule on every backend: a NaN logit counts as
``-inf`` (that candidate is never picked, greedy or sampled); when a row holds
``+inf`` logits the whole mass is shared equally by them (the limit of the
softmax); a row with no finite or ``+inf`` logit at all (every one ``-inf`` or
NaN) picks id 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dtypes import Dtype
from ..errors import ShapeError
from .base import FLOAT_DTYPES, OpDef, Params, expect_dtype, expect_rank, f64
from .registry import register_op
from .shape import norm_dim

__all__ = ["ArgmaxParams", "SamplingParams", "sampling_uniforms", "sample_sorted", "finite_logits",
           "sampling_weights"]

_ARGMAX_DTYPES = FLOAT_DTYPES | {Dtype.INT8, Dtype.UINT8, Dtype.INT32, Dtype.INT64}


@dataclass(frozen=True)
class ArgmaxParams(Params):
    """``dim`` (alias ``axis``, default -1) and ``keepdim`` (default False)."""

    ALIASES = {"axis": "dim", "keep_dim": "keepdim", "keepdims": "keepdim"}
    dim: int = -1
    keepdim: bool = False


@register_op
class Argmax(OpDef):
    """Index (int64) of the first maximum along ``dim``."""

    name = "Argmax"
    aliases = ("ArgmaxOperation", "ArgMax")
    Params = ArgmaxParams
    inputs = ("x",)
    outputs = ("ids",)

    def infer_shape(self, p, ins):
        x = ins["x"]
        expect_dtype(self.name, "x", x, _ARGMAX_DTYPES)
        if x.rank == 0:
            raise ShapeError(self.name, "input 'x' rank", "rank >= 1", "a scalar")
        d = norm_dim(self.name, "dim", p.dim, x.rank, x.shape)
        if x.shape[d] == 0:
            raise ShapeError(self.name, f"input 'x' dim {d} is empty", "size >= 1",
                             f"shape {list(x.shape)}")
        shape = x.shape[:d] + ((1,) if p.keepdim else ()) + x.shape[d + 1:]
        return [x.replace(shape=shape, dtype=Dtype.INT64)]

    def reference(self, p, ins):
        x = f64(ins["x"])  # exact for every input dtype, so ties stay ties
        d = p.dim % x.ndim
        ids = np.argmax(x, axis=d)
        if p.keepdim:
            ids = np.expand_dims(ids, d)
        return [np.asarray(ids, dtype=np.int64)]


@dataclass(frozen=True)
class SamplingParams(Params):
    """``top_k`` (0 = off), ``top_p`` in (0, 1], ``temperature`` >= 0 (0 = greedy),
    ``seed`` (non-negative int; the same seed gives the same ids)."""

    ALIASES = {"topk": "top_k", "topp": "top_p", "rand_seed": "seed", "random_seed": "seed"}
    top_k: int = 0
    top_p: float = 1.0
    temperature: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        if not isinstance(self.top_k, (int, np.integer)) or isinstance(self.top_k, bool) \
                or self.top_k < 0:
            self.fail("top_k", "an integer >= 0 (0 = off)", repr(self.top_k))
        if not 0.0 < self.top_p <= 1.0:
            self.fail("top_p", "a value in (0, 1]", self.top_p)
        if not self.temperature >= 0.0:
            self.fail("temperature", ">= 0 (0 = greedy)", self.temperature)
        if not isinstance(self.seed, (int, np.integer)) or isinstance(self.seed, bool) \
                or self.seed < 0:
            self.fail("seed", "a non-negative integer", repr(self.seed))


def sampling_uniforms(seed: int, rows: int) -> np.ndarray:
    """The one uniform per row every backend uses: float64 ``[rows]`` in [0, 1)."""
    return np.random.default_rng(int(seed)).random(rows)


def finite_logits(x, xp):
    """Logits with NaN read as ``-inf`` (``xp`` is numpy or torch): the rule of the
    module docstring, shared by the reference and the kernels."""
    return xp.where(xp.isnan(x), -xp.inf if xp is np else float("-inf"), x)


def sampling_weights(sl, xp):
    """Unnormalised softmax weights of descending logits ``sl`` [B, V] (the max
    first), with the module docstring's rule for +inf and all -inf rows."""
    top = sl[:, :1]
    with np.errstate(invalid="ignore"):
        e = xp.exp(sl - top)
    pos_inf = xp.isposinf(top)
    e = xp.where(pos_inf, xp.isposinf(sl) * 1.0, e)      # +inf rows: the +inf share
    first = xp.zeros_like(e)
    first[:, 0] = 1.0
    return xp.where(xp.isneginf(top), first, e)           # nothing finite: id sorted first


def sample_sorted(sorted_logits: np.ndarray, u: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Steps 3-5 on float64 logits already divided by the temperature and sorted in
    descending order: the position (in sorted order) each row samples."""
    e = sampling_weights(sorted_logits, np)  # [B, V], the max is first
    probs = e / e.sum(axis=-1, keepdims=True)
    v = probs.shape[-1]
    keep = np.ones_like(probs, dtype=bool)
    if p.top_k:
        keep[:, min(p.top_k, v):] = False
        probs = np.where(keep, probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    if p.top_p < 1.0:
        c = np.cumsum(probs, axis=-1)
        before = np.concatenate([np.zeros_like(c[:, :1]), c[:, :-1]], axis=-1)
        keep &= before < p.top_p  # smallest prefix whose cumsum reaches top_p
        probs = np.where(keep, probs, 0.0)
    c = np.cumsum(probs, axis=-1)
    c = c / c[:, -1:]  # ends at exactly 1.0 > u, so some candidate always exceeds u
    return (c <= u[:, None]).sum(axis=-1)


@register_op
class TopkToppSampling(OpDef):
    """``logits [B, V] -> ids int64 [B]``; see the module docstring for the exact,
    backend-independent procedure."""

    name = "TopkToppSampling"
    aliases = ("TopkToppSamplingOperation", "Sampling")
    Params = SamplingParams
    inputs = ("logits",)
    outputs = ("ids",)

    def infer_shape(self, p, ins):
        x = ins["logits"]
        expect_rank(self.name, "logits", x, 2)
        expect_dtype(self.name, "logits", x, FLOAT_DTYPES)
        if x.shape[1] == 0:
            raise ShapeError(self.name, "input 'logits' vocabulary is empty", "V >= 1",
                             f"shape {list(x.shape)}")
        return [x.replace(shape=(x.shape[0],), dtype=Dtype.INT64)]

    def reference(self, p, ins):
        x = finite_logits(f64(ins["logits"]), np)
        if p.temperature == 0.0:
            return [np.argmax(x, axis=-1).astype(np.int64)]
        x = x / p.temperature
        order = np.argsort(-x, axis=-1, kind="stable")  # [B, V] descending, ties by index
        pos = sample_sorted(np.take_along_axis(x, order, axis=-1),
                            sampling_uniforms(p.seed, x.shape[0]), p)
        return [np.take_along_axis(order, pos[:, None], axis=-1)[:, 0].astype(np.int64)]
