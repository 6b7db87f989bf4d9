"""``MemoryPoolConfig``: the settings of a memory pool (validated on construction)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..errors import ParamsError

__all__ = ["MemoryPoolConfig"]


@dataclass(frozen=True)
class MemoryPoolConfig:
    """Settings of a :class:`~atbcore.memory.pool.MemoryPool`.

    ``max_size``: bytes the pool may reserve in all (arenas together).
    ``growth_factor``: each new arena is this many times the previous one (>= 1).
    ``enable_defrag``: defragment automatically before an allocation would fail.
    ``device``: ``"cpu"``, ``"cuda[:i]"``, ``"npu[:i]"`` (torch tensors) or ``"numpy"``.
    ``alignment``: block alignment in bytes, a power of two >= 64.
    ``initial_size``: bytes of the first arena (default ``min(max_size, 16 MiB)``).
    ``release_threshold``: bytes of *empty* arenas (no live block) the pool keeps for
    reuse. When a free leaves an arena empty and the empty arenas together exceed
    this, the largest go back to the device (on the CPU, the memory to the OS) until
    they do not. ``0`` (default) keeps none; ``None`` keeps all until
    :meth:`~atbcore.memory.pool.MemoryPool.trim`. Arenas that still hold a block are
    never given back, however little of them is used.

        MemoryPoolConfig(max_size=16 * 1024**3, growth_factor=1.5, enable_defrag=True)
    """

    max_size: int
    growth_factor: float = 1.5
    enable_defrag: bool = False
    device: str = "cpu"
    alignment: int = 64
    initial_size: int | None = None
    release_threshold: int | None = 0

    DEFAULT_INITIAL: ClassVar[int] = 16 << 20

    def __post_init__(self) -> None:
        def bad(what: str, expected: str, given: object) -> None:
            raise ParamsError("MemoryPoolConfig", what, expected, repr(given))

        if isinstance(self.max_size, bool) or not isinstance(self.max_size, int) or self.max_size <= 0:
            bad("max_size", "an int > 0 (bytes)", self.max_size)
        if not isinstance(self.growth_factor, (int, float)) or not self.growth_factor >= 1.0:
            bad("growth_factor", "a number >= 1.0", self.growth_factor)
        a = self.alignment
        if isinstance(a, bool) or not isinstance(a, int) or a < 64 or a & (a - 1):
            bad("alignment", "a power of two >= 64", a)
        if self.max_size < a:
            bad("max_size", f">= alignment ({a})", self.max_size)
        init = self.initial_size
        if init is not None and (isinstance(init, bool) or not isinstance(init, int)
                                 or not 0 < init <= self.max_size):
            bad("initial_size", f"an int in (0, max_size={self.max_size}]", init)
        keep = self.release_threshold
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 0):
            bad("release_threshold", "an int >= 0 (bytes) or None", keep)
        if not isinstance(self.device, str) or not self.device:
            bad("device", "a device string such as 'cpu', 'cuda:0' or 'numpy'", self.device)
