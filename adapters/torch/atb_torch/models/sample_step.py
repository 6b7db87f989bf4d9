"""One decoding step's token from the fp32 logits: the processors, then argmax or the
draw, as Hugging Face's ``_sample`` does it (``token_picker``).

Sampling's usual processor tail — temperature, top-k, top-p (Hugging Face adds top-k
50 by default) — leaves at most k finite scores in a row of -inf, and the draw,
``torch.multinomial(softmax(row), 1)``, can only pick one of them. So when the list
ends with that tail, the step works on the k + 1 largest logits alone and never
writes a vocabulary-sized row:

1. ``topk(k + 1)`` of the logits; the temperature divides those values only (the
   same elementwise division; it keeps their order, and a tie it makes at the k-th
   value is seen). A tie at the k-th value or a NaN: the general path below.
2. Top-p's cut over those k values (:func:`.top_p.top_p_kept_counts`).
3. The survivors' probabilities with the bits ``softmax`` gives them in the full
   row (:func:`softmax_at`), and the draw at their positions
   (:func:`.sampler.draw_at`): the same token and generator state as
   ``torch.multinomial``.

The three run first as one C call (``csrc/sample.c``): after a decode step has
streamed the weights through the caches, each torch or NumPy call of the steps
above starts cold, and their count, not their arithmetic, is what a step costs.
The C step computes the softmax and top-p's sums in double and decides only when
the result holds for any rounding torch's float32 could make (a margin on top-p's
cut and between the best two draws); otherwise, rarely, the steps above decide.

Anything else (other warpers after top-p, a fill other than -inf, non-CPU or
non-fp32 scores, a row the fast path cannot decide) runs the processors
(:func:`.processors.accelerate`) and then softmax and :func:`.sampler.sample`.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch

from .processors import Processor, accelerate, accelerate_tracked
from .sampler import draw_at, sample, verified
from .top_p import ALIGN, plain, top_k_kept, top_p_kept_counts
from atbcore.backends.cpu_kernels import available
from atbcore.backends.cpu_kernels.torch_decode import argmax_rows
from atbcore.backends.cpu_kernels.torch_sampling import TOPK_MAX, sample_top_k

_ARGMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

__all__ = ["softmax_at", "token_picker"]

Picker = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# vocabulary size -> whether softmax_at's compact row gives the full row's bits here
_COMPACT_EXACT: dict[int, bool] = {}


def _compact_columns(cols: np.ndarray) -> np.ndarray:
    """Positions for ``cols`` (ascending) in a short row: the same order and the same
    column modulo :data:`ALIGN`, each gap cut to at most ALIGN."""
    gaps = np.diff(cols, prepend=-1)
    return np.cumsum((gaps - 1) % ALIGN + 1) - 1


def _softmax_compact(vals: np.ndarray, cols: np.ndarray) -> np.ndarray:
    pos = _compact_columns(cols)
    n = -(-(int(pos[-1]) + 1) // ALIGN) * ALIGN
    row = np.full((1, n), -np.inf, dtype=np.float32)
    row[0, pos] = vals
    return torch.from_numpy(row).softmax(dim=-1).numpy()[0, pos]


def _softmax_full(vals: np.ndarray, cols: np.ndarray, v: int) -> np.ndarray:
    row = np.full((1, v), -np.inf, dtype=np.float32)
    row[0, cols] = vals
    return torch.from_numpy(row).softmax(dim=-1).numpy()[0, cols]


def _compact_exact(v: int) -> bool:
    """Whether torch's row softmax sums a row of -inf but at scattered columns as it
    sums the compact row (one accumulator whose lanes take the columns modulo the
    vector width, a divisor of ALIGN): checked once per vocabulary size on random
    rows against the full row."""
    if v not in _COMPACT_EXACT:
        g = torch.Generator().manual_seed(v)
        ok = True
        for trial in range(24):
            k = 1 + int(torch.randint(0, min(v, 400), (1,), generator=g))
            cols = np.sort(torch.randperm(v, generator=g)[:k].numpy())
            vals = (torch.randn(k, generator=g) * (1 + trial % 6)).numpy()
            ok = ok and np.array_equal(_softmax_compact(vals, cols), _softmax_full(vals, cols, v))
        _COMPACT_EXACT[v] = ok
    return _COMPACT_EXACT[v]


def softmax_at(vals: np.ndarray, cols: np.ndarray, v: int) -> np.ndarray:
    """``softmax(row)[cols]`` for the ``v``-column row that is -inf but ``vals`` at
    ``cols`` (ascending), the same bits, without writing the whole row when
    :func:`_compact_exact` holds for ``v``."""
    if _compact_exact(v):
        return _softmax_compact(vals, cols)
    return _softmax_full(vals, cols, v)


def _divides_as_torch(temperature: Any) -> bool:
    """Whether Hugging Face's temperature warper gives ``x / float32(t)`` (the C
    step's division) on a probe row."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 20
    return np.array_equal(temperature(None, x).numpy(),
                          x.numpy() / np.float32(temperature.temperature))


class _CandidateSampler:
    """The fused tail (module docstring): ``(ids, scores) -> tokens``, or None where
    the general path must run. The whole step runs as one C call
    (:func:`atbcore.backends.cpu_kernels.torch_sampling.sample_top_k`) where it can
    be sure of Hugging Face's token, else as the NumPy/torch steps here."""

    def __init__(self, temperature: Any, k_proc: Any, p_proc: Any) -> None:
        self.k = int(k_proc.top_k)
        self.temperature = temperature
        self.top_p = p_proc
        self.limit, self.keep = np.float32(-1), 1
        if p_proc is not None:
            self.limit = np.float32(1 - float(p_proc.top_p))
            self.keep = int(p_proc.min_tokens_to_keep)
        self.in_c = self.k <= TOPK_MAX and (temperature is None or _divides_as_torch(temperature))
        self.c_args = (self.k, 0.0 if temperature is None else float(temperature.temperature),
                       int(temperature is not None), float(self.limit), self.keep)

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor | None:
        if self.in_c and scores.is_contiguous():
            tok = sample_top_k(scores, *self.c_args)
            if tok is not None:
                return tok
        then = None if self.temperature is None else (lambda x: self.temperature(ids, x))
        kept = top_k_kept(scores, self.k, then)
        if kept is None:
            return None
        vals, idx = kept                                        # [B, k] descending
        if not np.isfinite(vals).all():
            return None  # +inf (or -inf among the k): softmax's NaN/zeros, torch decides
        b, v = scores.shape
        counts = np.full(b, self.k) if self.top_p is None else \
            top_p_kept_counts(vals, v, self.limit, self.keep)
        if counts is None:
            return None
        flat, probs, bounds = [], [], [0]
        for r in range(b):
            cols, order = np.sort(idx[r, :counts[r]]), np.argsort(idx[r, :counts[r]])
            probs.append(softmax_at(vals[r, order], cols, v))
            flat.append(cols + r * v)
            bounds.append(bounds[-1] + len(cols))
        return draw_at(np.concatenate(flat), np.concatenate(probs), np.asarray(bounds), b * v)


def _fused_tail(procs: list) -> tuple[list, _CandidateSampler] | None:
    """(the processors before the tail, the fused sampler) when ``procs`` ends with
    [temperature,] top-k [, top-p], each with the fill -inf; None otherwise."""
    from transformers.generation import logits_process as lp

    head = list(procs)
    p_proc = head.pop() if head and type(head[-1]) is lp.TopPLogitsWarper else None
    if not head or type(head[-1]) is not lp.TopKLogitsWarper:
        return None
    k_proc = head.pop()
    temp = head.pop() if head and type(head[-1]) is lp.TemperatureLogitsWarper else None
    if k_proc.filter_value != -math.inf or (p_proc is not None
                                           and p_proc.filter_value != -math.inf):
        return None
    return head, _CandidateSampler(temp, k_proc, p_proc)


def _run(procs: list[Processor], ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    for proc in procs:
        scores = proc(ids, scores)
    return scores


def _argmax(scores: torch.Tensor) -> torch.Tensor:
    """``scores.argmax(dim=-1)``: one C call on CPU rows (torch's argmax reduction is
    not vectorised over a row and runs single-threaded in a parked step)."""
    if scores.is_cpu and scores.dtype in _ARGMAX_DTYPES and scores.dim() == 2 \
            and scores.shape[-1] and available():
        return argmax_rows(scores)
    return scores.argmax(dim=-1)


def token_picker(processors: Any, do_sample: bool) -> Picker:
    """``pick(ids, scores) -> tokens [B]``: Hugging Face's processors over ``scores``
    (``[B, V]``, a private fp32 copy the call may write into), then the argmax, or
    with ``do_sample`` the token ``torch.multinomial(softmax(scores), 1)`` draws. A
    picker with ``reads_only`` set (greedy, no processors) only reads ``scores``: the
    caller may pass the logits themselves, in any float dtype."""
    procs = list(processors)
    fused = _fused_tail(procs) if do_sample else None
    if fused is None:
        every = accelerate(procs)
        if do_sample:
            return lambda ids, scores: sample(torch.softmax(_run(every, ids, scores), dim=-1))
        if not every:  # plain greedy: the argmax reads the logits, writes nothing
            def argmax(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                return _argmax(scores)
            argmax.reads_only = True  # type: ignore[attr-defined]
            return argmax
        return lambda ids, scores: _argmax(_run(every, ids, scores))
    head_procs, tail = fused
    head, private = accelerate_tracked(head_procs)
    # the tail's own fast forms, for the rows the fused step leaves to the general path
    rest = accelerate(procs[len(head_procs):], private)

    def pick(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = _run(head, ids, scores)
        if plain(scores) and verified():
            tok = tail(ids, scores)
            if tok is not None:
                return tok
        return sample(torch.softmax(_run(rest, ids, scores), dim=-1))

    return pick
