"""Top-k and top-p (Hugging Face's ``TopKLogitsWarper`` / ``TopPLogitsWarper``) as
faster functions giving the same scores bit for bit (used by :mod:`.processors`).

* Top-p: Hugging Face sorts the whole vocabulary with indices (an argsort:
  milliseconds at 32k tokens). Only the sorted *values* are needed to find the cut —
  the ascending cumulative softmax Hugging Face computes is a function of the sorted
  values alone — and NumPy's value sort is ~20x cheaper. The cumulative sum skips
  the leading zero probabilities (after top-k: all but tens of columns), which add
  nothing. The kept tokens are then those at or above the first kept value; if that
  value ties with the last removed one (which index Hugging Face removes then
  depends on its sort's order) the original runs.
* Top-k: ``topk`` of k + 1 entries; when exactly k are kept (no tie at the k-th
  value) the row is written once (fills, then the k values), else the ``topk``
  threshold and a NumPy fill. Followed by top-p (sampling's default pair), the two
  run as one (:func:`top_k_top_p`): the ascending sort top-p needs is the fills and
  the k values reversed, so the vocabulary is neither sorted nor filled twice; the
  cut over those k values is :func:`top_p_kept_counts`, which the sampling step
  (:mod:`.sample_step`) shares.

Each pass over a 32k-entry row costs tens of microseconds when the row is cold, as
it is after a decode step has streamed the weights through the caches: the fast
forms make as few of them as they can.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["plain", "top_k", "top_k_kept", "top_k_top_p", "top_p", "top_p_kept_counts"]

Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _fill_below(scores: torch.Tensor, threshold: np.ndarray, fill: float) -> torch.Tensor:
    """``scores.masked_fill(scores < threshold, fill)`` (``threshold`` [B, 1]) through
    NumPy: the same comparison (NaN is never below) and the same float32 fill,
    several times cheaper on a 32k row than torch's compare-and-fill here."""
    x = scores.numpy()
    y = x.copy()
    y[x < threshold] = fill
    return torch.from_numpy(y)


def _ascending_cumsum(probs: torch.Tensor) -> torch.Tensor:
    """``probs.cumsum(-1)`` of an ascending softmax row set, from the first column any
    row has a nonzero probability in: the zeros before it add nothing (torch's
    cumsum runs each row in order), so the sums are the same bits while the scan
    covers only the kept tail (after top-k: tens of columns, not the vocabulary)."""
    p = probs.numpy()
    nonzero = p != 0
    if np.isnan(p).any() or not nonzero.any(axis=-1).all():
        return probs.cumsum(dim=-1)
    start = int(nonzero.argmax(axis=-1).min())
    cum = torch.zeros_like(probs)
    cum[:, start:] = probs[:, start:].cumsum(dim=-1)
    return cum


def plain(scores: torch.Tensor) -> bool:
    """Scores the fast paths take: CPU float32 ``[B, V]``, no autograd."""
    return (scores.dtype == torch.float32 and scores.device.type == "cpu" and scores.dim() == 2
            and not scores.requires_grad)


def _top_p_cut(ordered: np.ndarray, limit: np.float32, keep: int) -> Any:
    """Top-p's cut over ``ordered`` (each row's scores ascending): the first kept value
    per row ``[B]``, ``"none"`` when nothing is removed, or None where Hugging Face's
    own must decide (NaN scores, a tie at the cut: then its sort order decides)."""
    cum = _ascending_cumsum(torch.from_numpy(ordered).softmax(dim=-1)).numpy()
    if np.isnan(cum[:, -1]).any():
        return None
    # removed: the prefix with cum <= limit, keeping at least `keep` at the top
    # (cum is nondecreasing: NumPy's right-side search finds torch.searchsorted's cut)
    v = ordered.shape[-1]
    cut = np.array([np.searchsorted(row, limit, side="right") for row in cum])
    cut = np.minimum(cut, max(v - keep, 0))
    if not cut.any():
        return "none"
    rows = np.arange(ordered.shape[0])
    first_kept = ordered[rows, np.minimum(cut, v - 1)]
    last_removed = ordered[rows, np.maximum(cut - 1, 0)]
    if ((first_kept == last_removed) & (cut > 0)).any():
        return None
    return first_kept


def top_p(proc: Any) -> Processor:
    """The fast form of a ``TopPLogitsWarper``."""
    keep, fill = int(proc.min_tokens_to_keep), proc.filter_value
    # Hugging Face compares float32 cumulative probabilities with this, cast to float32
    limit = np.float32(1 - float(proc.top_p))

    def call(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not plain(scores):
            return proc(ids, scores)
        first_kept = _top_p_cut(np.sort(scores.numpy(), axis=-1), limit, keep)
        if first_kept is None:
            return proc(ids, scores)
        if isinstance(first_kept, str):
            return scores
        return _fill_below(scores, first_kept[:, None], fill)

    return call


def top_k_kept(scores: torch.Tensor, k: int,
               then: Callable[[torch.Tensor], torch.Tensor] | None = None
               ) -> tuple[np.ndarray, np.ndarray] | None:
    """(values ``[B, k]`` descending, their columns) of what top-k keeps, when that is
    exactly ``k`` entries: no tie at the k-th value (Hugging Face keeps every tie) and
    no NaN among them; None otherwise. NumPy arrays: the rest is small-array work.

    ``then``: an elementwise, nondecreasing map (a temperature) that runs before the
    top-k, applied here to the k + 1 largest entries only: it keeps their order, and
    a tie it makes at the k-th value shows in what it returns."""
    if k >= scores.shape[-1]:
        return None
    vals, idx = torch.topk(scores, k + 1)
    if then is not None:
        vals = then(vals)
    v = vals.numpy()
    if np.isnan(v).any() or (v[:, k] == v[:, k - 1]).any():
        return None
    return v[:, :k], idx.numpy()[:, :k]


def _placed(like: torch.Tensor, fill: float, idx: np.ndarray, vals: np.ndarray
            ) -> torch.Tensor:
    """``fill`` everywhere but ``vals`` at columns ``idx``: one write of the row."""
    out = np.full(tuple(like.shape), fill, dtype=np.float32)
    np.put_along_axis(out, idx, vals, axis=1)
    return torch.from_numpy(out)


def top_k(proc: Any) -> Processor:
    """The fast form of a ``TopKLogitsWarper``."""
    k, fill = int(proc.top_k), proc.filter_value

    def general(scores: torch.Tensor) -> torch.Tensor:
        kth = torch.topk(scores, min(k, scores.shape[-1]))[0][..., -1:]  # [B, 1]
        return _fill_below(scores, kth.numpy(), fill)

    def call(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not plain(scores):
            return proc(ids, scores)
        kept = top_k_kept(scores, k)
        return general(scores) if kept is None else _placed(scores, fill, kept[1], kept[0])

    call.general = general  # type: ignore[attr-defined]
    return call


# the fused pair's softmax runs over the last multiple of ALIGN columns of the sorted
# row, which start at a multiple of ALIGN: torch's row softmax sums in vector lanes by
# column, and the columns before are exact zeros, so the sums are the same bits;
# checked against the whole row on first use (see _tail_softmax_exact)
ALIGN = 64
_tail_exact: list[bool] = []


def _tail_softmax_exact() -> bool:
    """Whether the softmax of an ALIGN-aligned tail after -inf columns gives the whole
    row's softmax bits on this machine (its torch build and vector width)."""
    if not _tail_exact:
        g = torch.Generator().manual_seed(0)
        ok = True
        for v, k in ((32000, 50), (4096, 64), (151936, 65), (2048, 1), (8192, 300)):
            row = torch.full((1, v), -math.inf)
            row[:, v - k:] = (torch.randn(1, k, generator=g) * 4).sort(-1).values
            n = -(-k // ALIGN) * ALIGN
            ok = ok and torch.equal(row.softmax(-1)[:, v - n:],
                                    row[:, v - n:].contiguous().softmax(-1))
        _tail_exact.append(ok)
    return _tail_exact[0]


def _kept_probs(vals_asc: torch.Tensor, v: int) -> torch.Tensor:
    """Softmax of the row ``[-inf] * (v - k) + vals_asc`` ``[B, k]``, at its last
    columns only: ``[B, n]`` with n >= k the shortest aligned tail (or all v)."""
    b, k = vals_asc.shape
    n = -(-k // ALIGN) * ALIGN
    if v % ALIGN or n > v or not _tail_exact_ok():
        n = v
    row = torch.full((b, n), -math.inf)
    row[:, n - k:] = vals_asc
    return row.softmax(dim=-1)


def _tail_exact_ok() -> bool:
    return _tail_exact[0] if _tail_exact else _tail_softmax_exact()


def top_p_kept_counts(vals: np.ndarray, v: int, limit: np.float32, keep: int
                      ) -> np.ndarray | None:
    """How many of each row's top-k values ``vals`` ``[B, k]`` (descending, no tie at
    the k-th, no NaN) Hugging Face's top-p keeps when it runs on the row top-k left
    (those k values in ``v`` columns of -inf), as ``[B]``; None where its own must
    decide (NaN sums, a tie at the cut: its sort order decides then).

    That row sorted ascending is the -inf run and then the values reversed: its
    softmax is a softmax over an aligned tail (:data:`ALIGN`), its cumulative sum is
    0 over the -inf run (all removed, as ``cum <= 1 - top_p``) and is taken over the
    k values only."""
    b, k = vals.shape
    a = np.ascontiguousarray(vals[:, ::-1])                     # ascending
    probs = _kept_probs(torch.from_numpy(a), v)                 # [B, n] tail of the row
    tail = probs[:, probs.shape[1] - k:].cumsum(dim=-1).numpy()  # cum at columns v-k..
    if np.isnan(tail[:, -1]).any():
        return None
    # removed: the prefix with cum <= limit (cum is nondecreasing: NumPy's right-side
    # search finds torch.searchsorted's cut), keeping at least `keep` at the top
    cut = (v - k) + np.array([np.searchsorted(row, limit, side="right") for row in tail])
    cut = np.minimum(cut, max(v - keep, 0))
    rows = np.arange(b)
    first_kept = a[rows, np.clip(cut - (v - k), 0, k - 1)]
    last_removed = np.where(cut - 1 >= v - k, a[rows, np.clip(cut - 1 - (v - k), 0, k - 1)],
                            np.float32(-np.inf))
    if (cut < v - k).any() or ((first_kept == last_removed) & (cut > 0)).any():
        return None
    return v - cut


def top_k_top_p(k_proc: Any, p_proc: Any) -> Processor:
    """Top-k then top-p in one (``top-k``'s fill -inf): the survivors of
    :func:`top_p_kept_counts` written into one fresh row."""
    k_call, p_call = top_k(k_proc), top_p(p_proc)
    k_top = int(k_proc.top_k)
    keep, p_fill = int(p_proc.min_tokens_to_keep), p_proc.filter_value
    limit = np.float32(1 - float(p_proc.top_p))

    def call(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        kept = top_k_kept(scores, k_top) if plain(scores) else None
        if kept is None:
            return p_call(ids, k_call(ids, scores))
        vals, idx = kept                                            # [B, k] descending
        counts = top_p_kept_counts(vals, scores.shape[1], limit, keep)
        if counts is None:
            return p_call(ids, _placed(scores, -math.inf, idx, vals))  # HF's own decides
        survivors = np.where(np.arange(vals.shape[1]) < counts[:, None], vals,
                             np.float32(p_fill))
        return _placed(scores, p_fill, idx, survivors.astype(np.float32))

    return call
