"""Host memory on 2 MiB transparent huge pages, for the tensors decoding streams.

A decode step reads every weight once (and the KV cache); on 4 KiB pages that is a
TLB miss every 4 KiB. Placed on huge pages the same reads ran faster here (the
default model's weights through the C few-row matmul, 2-core Zen 4, Linux 6.18:
one row 5.7 -> 4.8 ms per step, 16 rows 10.6 -> 9.4 ms). On Linux an anonymous
mapping is advised ``MADV_HUGEPAGE`` before its first touch, so its page faults
take huge pages directly (no later copy); its 2 MiB-aligned slice backs the tensor.

Elsewhere (another OS, THP set to ``never``, ``ATB_HUGEPAGES=0``, or a tensor under
2 MiB) :func:`empty` is ``torch.empty``: nothing changes but the speed.

    from atbcore.memory.hugepages import empty, place
    buf = empty((4096, 4096), torch.float32)     # on huge pages where the OS allows
    w = place(w)                                  # a copy of w there (w if it cannot be)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import mmap
import os
import sys
import weakref
from pathlib import Path
from typing import Any

__all__ = ["available", "empty", "place", "placed", "Arena", "on_hugepages", "HUGE",
           "arena_scope", "weight_empty"]

HUGE = 2 << 20  # bytes per huge page (x86-64 and arm64 PMD size)
ARENA_MIN = 256 << 10  # prepared weights smaller than this stay off the arenas
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# storage address -> the mapping (weakly), for each mapping :func:`empty` made (so
# :func:`place` leaves a tensor already there where it is: a second compile of a
# model copies nothing)
_MAPPINGS: dict[int, Any] = {}


@functools.lru_cache(maxsize=4)
def _thp_mode(path: Path) -> str | None:
    """The kernel's THP setting (read once per path: it is asked per allocation)."""
    try:
        return path.read_text()
    except OSError:
        return None


def available() -> str | None:
    """Why tensors cannot be placed on huge pages here (None = they can)."""
    if os.environ.get("ATB_HUGEPAGES", "1").strip().lower() in ("0", "off", "false", "no"):
        return "disabled by ATB_HUGEPAGES=0"
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return f"transparent huge pages are a Linux feature ({sys.platform})"
    mode = _thp_mode(_THP)
    if mode is None:
        return "no transparent huge page support in this kernel"
    if "[never]" in mode:
        return "transparent huge pages are set to never"
    return None


def empty(shape: Any, dtype: Any) -> Any:
    """An uninitialised CPU tensor, on huge pages when :func:`available` and at least
    one huge page in size, else ``torch.empty``. The mapping lives as long as the
    tensor (and any view of it)."""
    import torch

    n = 1
    for s in shape:
        n *= int(s)
    nbytes = n * dtype.itemsize
    if nbytes < HUGE or available() is not None:
        return torch.empty(shape, dtype=dtype)
    # one huge page more than needed, so a 2 MiB-aligned start fits inside
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # refused by this kernel: plain pages, still correct
        pass
    raw = torch.frombuffer(m, dtype=torch.uint8)            # keeps the mapping alive
    key = raw.untyped_storage().data_ptr()
    # the mmap object lives exactly as long as the storage that exports it
    _MAPPINGS[key] = weakref.ref(m, lambda _, k=key: _MAPPINGS.pop(k, None))
    skip = -raw.data_ptr() % HUGE
    return raw[skip:skip + nbytes].view(dtype).view(tuple(int(s) for s in shape))


def placed(t: Any) -> bool:
    """True when ``t`` lives in a mapping :func:`empty` made (on huge pages)."""
    ref = _MAPPINGS.get(t.untyped_storage().data_ptr()) if t.device.type == "cpu" else None
    return ref is not None and ref() is not None


def place(t: Any) -> Any:
    """``t`` (a CPU tensor) copied onto huge pages, contiguous; ``t`` itself when it
    is not on the CPU, is under a huge page, is there already (contiguous), or huge
    pages are not available."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < HUGE or available() is not None:
        return t
    if t.is_contiguous() and placed(t):
        return t
    out = empty(t.shape, t.dtype)
    out.copy_(t)
    return out


class Arena:
    """Packs tensors side by side into huge-page chunks, in the order they are made:
    small weights (under a huge page each, which :func:`empty` leaves on plain pages)
    get huge pages too, and a decode step that reads them in order streams through
    contiguous memory. Tensors are views of a chunk, which lives while any of them
    does: give an arena only tensors that live and die together (one model's).

        arena = Arena()
        qkv = arena.empty((3 * 4096, 4096), torch.bfloat16)
        o = arena.place(o_weight)
    """

    def __init__(self, chunk_bytes: int = 16 << 20) -> None:
        self.chunk_bytes = int(chunk_bytes)
        self._chunk: Any = None
        self._used = 0

    def empty(self, shape: Any, dtype: Any) -> Any:
        """An uninitialised tensor in the arena (``torch.empty`` where huge pages are
        not available)."""
        import torch

        shape = tuple(int(s) for s in shape)
        n = 1
        for s in shape:
            n *= s
        nbytes = n * dtype.itemsize
        if available() is not None:
            return torch.empty(shape, dtype=dtype)
        start = -(-self._used // 64) * 64                  # cache-line aligned
        if self._chunk is None or start + nbytes > self._chunk.numel():
            size = max(self.chunk_bytes, -(-nbytes // HUGE) * HUGE)
            self._chunk, start = empty((size,), torch.uint8), 0
        self._used = start + nbytes
        return self._chunk[start:start + nbytes].view(dtype).view(shape)

    def place(self, t: Any) -> Any:
        """A contiguous copy of CPU tensor ``t`` in the arena (``t`` itself off the CPU)."""
        if t.device.type != "cpu":
            return t
        out = self.empty(t.shape, t.dtype)
        out.copy_(t)
        return out


_ARENA: "contextvars.ContextVar[Arena | None]" = contextvars.ContextVar("atb_weight_arena",
                                                                        default=None)


@contextlib.contextmanager
def arena_scope(arena: "Arena | None") -> Any:
    """Within the block, :func:`weight_empty` packs into ``arena`` (a GraphOp binding
    its plans puts the weight layouts it makes into its own arena)."""
    token = _ARENA.set(arena)
    try:
        yield arena
    finally:
        _ARENA.reset(token)


def weight_empty(shape: Any, dtype: Any) -> Any:
    """An uninitialised tensor for a prepared weight: in the current
    :func:`arena_scope` arena (weights under a huge page get huge pages too, and one
    model's weights lie side by side), else :func:`empty`. Weights under
    ``ARENA_MIN`` bytes stay out of the arena (a GraphOp of tiny layers would pin a
    whole huge page for them)."""
    arena = _ARENA.get()
    n = dtype.itemsize
    for d in shape:
        n *= int(d)
    if arena is None or n < ARENA_MIN:  # a tiny weight is no TLB cost; a chunk would be
        return empty(shape, dtype)
    return arena.empty(shape, dtype)


def on_hugepages(t: Any) -> int:
    """Bytes of the mapping holding ``t``'s first element that the kernel backs with
    huge pages now (``AnonHugePages`` of its ``/proc/self/smaps`` entry; 0 off Linux)."""
    addr = t.data_ptr()
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0
