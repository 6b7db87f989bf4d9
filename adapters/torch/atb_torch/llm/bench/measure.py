"""Measurement tools of ``atb bench``: op counting, allocator peaks, resident bytes,
interleaved timing and the weight-matmul floor.

What each number means (the bench prints and stores them as is):

* **launches per step** — for Hugging Face eager, the aten ops a decode step dispatches
  that compute something (every op whose schema is not a view, counted by a
  ``TorchDispatchMode``); for atb, the executor's own launch counter (each chosen
  kernel's declared launches).
* **peak memory** — ``resident`` bytes (unique tensor storages the model holds:
  weights, preallocated caches) plus the **allocator-level** transient peak of one run,
  read from ``torch.profiler`` memory events (every CPU/CUDA allocator allocation and
  free in time order; the running sum's maximum above the level at the start).
  Process RSS is not used: it carries other allocations and the parent's history.
* **weight-matmul floor** — the time of the weight matmuls of one decode step alone
  (each weight once, at the batch's row count, best of ``F.linear`` and a matmul
  against a pre-transposed copy, whole passes so weights come from memory, not
  cache): what a step costs with torch's matmul kernels when everything else is free.
* **bandwidth floor** — the weight bytes over the machine's measured read bandwidth
  (:func:`read_bandwidth`: 1 GiB, all threads, vectorized reductions, the fastest kept):
  the hardware limit of decoding from memory, which better GEMV kernels (llama.cpp's,
  say) approach more closely than torch's. Weights small enough to stay partly in L3
  can beat it; the table then says so.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "count_ops", "allocator_peak", "resident_bytes", "interleaved",
           "median", "weight_matmul_floor", "read_bandwidth", "quiet_stderr"]


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it: ``compute`` (non-view) and ``views``;
    ``by_op`` maps op name to count (compute ops only)."""

    def __init__(self) -> None:
        super().__init__()
        self.compute = 0
        self.views = 0
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        if func.is_view:
            self.views += 1
        else:
            self.compute += 1
            key = str(func.overloadpacket)
            self.by_op[key] = self.by_op.get(key, 0) + 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], Any]) -> OpCounter:
    """Run ``fn`` once under an :class:`OpCounter` and return the counter."""
    with OpCounter() as c:
        fn()
    return c


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (kineto prints start/stop lines from C++)."""
    try:
        fd = os.dup(2)
    except OSError:  # no stderr to silence
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)
        os.close(devnull)


def allocator_peak(fn: Callable[[], Any]) -> int:
    """Peak bytes allocated (above the level at the start) while ``fn`` runs, from the
    profiler's allocator events; frees of older blocks are not seen, so the peak is
    never understated by them."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    cur = peak = 0
    for _, n in events:
        cur += n
        peak = max(peak, cur)
    return peak


def _tensors_in(obj: Any, seen: set[int], depth: int) -> Iterator[torch.Tensor]:
    """Tensors reachable from ``obj`` through modules, containers and attributes."""
    if depth < 0 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        yield obj
        return
    if isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
    # snapshots: another thread (an engine loop, a plan cache) may add entries meanwhile
    if isinstance(obj, Mapping):
        items: Iterable[Any] = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = list(vars(obj).values())
    elif hasattr(obj, "__slots__"):
        items = [getattr(obj, s, None) for s in obj.__slots__]
    else:
        return
    for v in items:
        if isinstance(v, (str, bytes, int, float, bool, type(None))):
            continue
        yield from _tensors_in(v, seen, depth - 1)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Byte range ``[start, end)`` of ``t``'s elements inside its storage."""
    size = t.element_size()
    start = t.storage_offset() * size
    if t.numel() == 0:
        return start, start
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return start, start + (last + 1) * size


def _np_extent(a: np.ndarray) -> tuple[tuple[str, int], tuple[int, int]]:
    """(storage key, [byte range]) of a NumPy array inside the buffer it views (the
    key a torch tensor over the same buffer gets)."""
    try:
        from numpy.lib.array_utils import byte_bounds
    except ImportError:  # NumPy < 2
        byte_bounds = np.byte_bounds
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    base = root.__array_interface__["data"][0]
    lo, hi = byte_bounds(a) if a.size else (a.__array_interface__["data"][0],) * 2
    return ("cpu", base), (lo - base, hi - base)


def resident_bytes(*objs: Any, depth: int = 12) -> int:
    """Bytes of tensor memory reachable from ``objs`` (weights, caches, packed copies,
    plan buffers): per storage, the union of the byte ranges its reachable tensors
    cover, so shared storages count once and a view into a larger arena (a cache
    taken from a memory pool) counts its own bytes, not the whole arena."""
    seen: set[int] = set()
    ranges: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for obj in objs:
        for t in _tensors_in(obj, seen, depth):
            if isinstance(t, np.ndarray):  # host weights of a core plan
                key, span = _np_extent(t)
                ranges.setdefault(key, []).append(span)
                continue
            if t.is_meta:
                continue
            try:
                key = (str(t.device), t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # e.g. subclasses without storage
                key = (str(t.device), id(t))
            ranges.setdefault(key, []).append(_extent(t))
    total = 0
    for spans in ranges.values():
        end = -1
        for a, b in sorted(spans):  # union of intervals
            if a >= end:
                total += b - a
                end = b
            elif b > end:
                total += b - end
                end = b
    return total


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return float(statistics.median(xs)) if xs else float("nan")


def interleaved(runs: Mapping[str, Callable[[], Any]], repeats: int, warmup: int = 1,
                on_step: Callable[[str], None] | None = None) -> dict[str, list[tuple[float, Any]]]:
    """Run each callable ``warmup`` times, then ``repeats`` rounds of all of them in
    turn (ABAB..., the order rotated each round so none always follows the same one).
    Returns ``(wall seconds, result)`` of every timed run per name; ``on_step(name)``
    is called after each run (progress bars)."""
    names = list(runs)
    for _ in range(warmup):
        for n in names:
            runs[n]()
            if on_step:
                on_step(n)
    out: dict[str, list[tuple[float, Any]]] = {n: [] for n in names}
    for r in range(repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            t0 = time.perf_counter()
            res = runs[n]()
            out[n].append((time.perf_counter() - t0, res))
            if on_step:
                on_step(n)
    return out


def _time_best(fn: Callable[[], Any], repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def weight_matmul_floor(weights: Iterable[torch.Tensor], rows: int, dtype: torch.dtype,
                        quantize: str | None = None, repeats: int = 5) -> dict[str, float]:
    """Seconds the weight matmuls of one decode step take alone (see module doc).

    ``weights`` are ``[out, in]`` matrices (every projection of every layer and the LM
    head, each once). With ``quantize="w8"`` each weight is int8 per output channel
    and timed through ``aten._weight_int8pack_mm`` (bf16 activations), the weight-only
    int8 kernel; with ``"w4"`` the C w4 matmul on group-32 4-bit codes. Each matmul's faster form is picked first (fp32/bf16: ``F.linear`` or a
    matmul against a pre-transposed copy); the floor is the best of ``repeats`` passes
    over all of them after warm-up passes (first calls of a shape are slow).
    Returns ``seconds``, ``bytes`` (weight bytes read) and ``gbps``."""
    calls: list[Callable[[], Any]] = []
    nbytes = 0
    with torch.inference_mode():
        for w in weights:
            w = w.detach()
            if quantize == "w4":  # the C w4 matmul on symmetric group-32 codes
                from atbcore.backends.cpu_kernels.torch_linear_w4 import (linear_w4, pack_w4,
                                                                          quantize_w4)

                w4 = pack_w4(*quantize_w4(w.float()), k=w.shape[1])
                x = torch.randn(rows, w.shape[1], dtype=dtype)
                calls.append(lambda x=x, w4=w4: linear_w4(x, w4))
                nbytes += w4.nbytes
            elif quantize in ("w8", "w8a8"):  # int8 weights: the bytes a step reads
                scale = w.float().abs().amax(dim=1).clamp_min(1e-8) / 127.0
                q = torch.round(w.float() / scale[:, None]).to(torch.int8).contiguous()
                x = torch.randn(rows, w.shape[1], dtype=torch.bfloat16)
                s = scale.to(torch.bfloat16)
                calls.append(lambda x=x, q=q, s=s: torch.ops.aten._weight_int8pack_mm(x, q, s))
                nbytes += q.numel() + s.numel() * 2
            else:
                wd = w.to(dtype).contiguous()
                wt = wd.t().contiguous()
                x = torch.randn(rows, w.shape[1], dtype=dtype)
                a = lambda x=x, wd=wd: torch.nn.functional.linear(x, wd)  # noqa: E731
                b = lambda x=x, wt=wt: torch.mm(x, wt)  # noqa: E731
                calls.append(a if _time_best(a, 3) <= _time_best(b, 3) else b)
                nbytes += wd.numel() * wd.element_size()

        def step() -> None:
            for c in calls:
                c()
        total = _time_best(step, repeats)
    return {"seconds": total, "bytes": nbytes, "gbps": nbytes / total / 1e9 if total else 0.0}


#: Ways :func:`read_bandwidth` streams its buffer; the fastest one counts. Both are
#: ATen reductions (vectorized at torch's CPU capability, AVX-512 where present) split
#: over all intra-op threads: a whole-buffer sum, and row sums of 16 KiB rows (one
#: independent accumulator per row, so the threads never meet in a final combine).
READ_METHODS: dict[str, Callable[[torch.Tensor], Any]] = {
    "sum": lambda x: x.sum(),
    "row_sums": lambda x: x.view(-1, 4096).sum(1),
}


def read_bandwidth(nbytes: int = 2**30, repeats: int = 7, detail: bool = False) -> Any:
    """Memory read bandwidth in GB/s: the best of :data:`READ_METHODS` over a buffer of
    ``nbytes`` (1 GiB: far beyond any cache, so L3 cannot help), each the best of
    ``repeats`` passes on all torch threads. The highest rate any method reaches is
    kept, since the bandwidth floor must be a true upper bound of decode speed.

    ``detail=True`` returns ``{"gbps", "bytes", "method", "threads", "by_method"}``."""
    nbytes -= nbytes % (4 * 4096)
    x = torch.ones(nbytes // 4)
    by_method = {name: nbytes / _time_best(lambda f=f: f(x), repeats, warmup=1) / 1e9
                 for name, f in READ_METHODS.items()}
    del x
    method = max(by_method, key=by_method.__getitem__)
    if not detail:
        return by_method[method]
    return {"gbps": by_method[method], "bytes": nbytes, "method": method,
            "threads": torch.get_num_threads(), "by_method": by_method}
