"""Hypothesis state machines over random alloc / free / defragment / grow / release
sequences, checking the pool's invariants after every step: live blocks and free
segments tile every arena without overlap, allocated + free = reserved, contents of
live blocks survive every move, and the statistics agree with the layout."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from atbcore.errors import MemoryError_, PoolExhaustedError
from atbcore.memory.config import MemoryPoolConfig
from atbcore.memory.naive import NaiveAllocator
from atbcore.memory.pool import MemoryPool

MAX = 48 * 1024
ALIGN = 64


def _align(n: int) -> int:
    return -(-max(n, 1) // ALIGN) * ALIGN


def _address(t) -> int:
    return int(t.data_ptr()) if hasattr(t, "data_ptr") else int(t.ctypes.data)


def _read(t) -> np.ndarray:
    """Host copy of a block's bytes (torch tensors may live on an accelerator)."""
    return t.cpu().numpy() if hasattr(t, "cpu") else np.array(t)


def _write(t, payload: np.ndarray) -> None:
    if hasattr(t, "copy_"):
        import torch

        t.copy_(torch.from_numpy(payload))
    else:
        t[:] = payload


class PoolMachine(RuleBasedStateMachine):
    device = "numpy"
    defrag = False
    cls = MemoryPool

    def __init__(self) -> None:
        super().__init__()
        self.pool = self.cls(MemoryPoolConfig(max_size=MAX, initial_size=4096, growth_factor=1.5,
                                              enable_defrag=self.defrag, device=self.device))
        self.rng = np.random.default_rng(1234)
        self.expected: dict[object, np.ndarray] = {}
        self.freed: list[object] = []

    # ------------------------------------------------------------------ rules
    @rule(n=st.integers(0, 9000), pinned=st.booleans())
    def alloc(self, n: int, pinned: bool) -> None:
        before = self.pool.stats()
        try:
            blk = self.pool.alloc(n, pinned=pinned)
        except PoolExhaustedError as e:
            after = self.pool.stats()
            need = _align(n)
            # A refusal is legitimate only when no hole and no room to grow could hold it.
            assert need > after["largest_free_block"], (need, after)
            assert need > MAX - after["reserved"], (need, after)
            assert after["allocated"] == before["allocated"]
            assert after["num_blocks"] == before["num_blocks"]
            assert after["failed_allocs"] == before["failed_allocs"] + 1
            assert "reserved=" in str(e) and "largest_free_block=" in str(e)
            return
        assert blk.nbytes == n and blk.size == _align(n)
        payload = self.rng.integers(0, 256, size=n, dtype=np.uint8)
        _write(blk.raw(), payload)
        self.expected[blk] = payload

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def free(self, data) -> None:
        blk = data.draw(st.sampled_from(sorted(self.expected, key=lambda b: b.id)))
        blk.free()
        del self.expected[blk]
        self.freed.append(blk)

    @rule()
    def defragment(self) -> None:
        pinned = {b: b.location for b in self.expected if b.pinned}
        before = self.pool.stats()
        report = self.pool.defragment()
        after = self.pool.stats()
        for b, loc in pinned.items():
            assert b.location == loc, "a pinned block moved"
        assert after["allocated"] == before["allocated"]
        assert before["reserved"] - after["reserved"] == report["released_bytes"]
        # After compaction no arena keeps a hole below a movable block that would fit it.
        for a in self.pool.layout():
            if a["free"] and not any(b.pinned for b in self.expected if b.location[0] == a["id"]):
                assert len(a["free"]) == 1 and sum(a["free"][0]) == a["size"]

    @rule(n=st.integers(1, 20000))
    def grow(self, n: int) -> None:
        try:
            self.pool.reserve(n)
        except PoolExhaustedError:
            s = self.pool.stats()
            assert _align(n) > s["largest_free_block"] and _align(n) > MAX - s["reserved"]
            return
        s = self.pool.stats()
        if isinstance(self.pool, NaiveAllocator):  # keeps nothing ahead, only checks room
            assert MAX - s["reserved"] >= n
        else:
            assert s["largest_free_block"] >= n

    @rule()
    def release(self) -> None:
        self.pool.release()
        assert all(a["live"] for a in self.pool.layout())

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def misuse(self, data) -> None:
        blk = data.draw(st.sampled_from(self.freed))
        before = self.pool.layout()
        with pytest.raises(MemoryError_, match="double free"):
            blk.free()
        with pytest.raises(MemoryError_, match="freed block"):
            blk.raw()
        assert self.pool.layout() == before

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def toggle_pin(self, data) -> None:
        blk = data.draw(st.sampled_from(sorted(self.expected, key=lambda b: b.id)))
        blk.unpin() if blk.pinned else blk.pin()

    # ------------------------------------------------------------------ invariants
    @invariant()
    def layout_tiles_arenas(self) -> None:
        layout = self.pool.layout()
        for a in layout:
            segs = sorted([(o, s, "live") for o, s, _ in a["live"]] +
                          [(o, s, "free") for o, s in a["free"]])
            cursor = 0
            for o, s, kind in segs:
                assert o == cursor, f"gap or overlap at {o} in arena {a['id']}: {segs}"
                assert o % ALIGN == 0 and s % ALIGN == 0 and s > 0
                cursor = o + s
            assert cursor == a["size"]
            frees = a["free"]
            for (o1, s1), (o2, _) in zip(frees, frees[1:]):
                assert o1 + s1 < o2, "adjacent free segments were not coalesced"

    @invariant()
    def stats_agree(self) -> None:
        s, layout = self.pool.stats(), self.pool.layout()
        live = sum(sz for a in layout for _, sz, _ in a["live"])
        free = sum(sz for a in layout for _, sz in a["free"])
        assert s["allocated"] == live
        assert s["free"] == free
        assert s["allocated"] + s["free"] == s["reserved"] == sum(a["size"] for a in layout)
        assert s["reserved"] <= MAX and s["peak"] >= s["allocated"]
        assert s["num_blocks"] == len(self.expected) == s["alloc_count"] - s["free_count"]
        assert s["requested"] == sum(b.nbytes for b in self.expected)
        assert s["num_arenas"] == len(layout)
        largest = max((sz for a in layout for _, sz in a["free"]), default=0)
        assert s["largest_free_block"] == largest
        assert s["fragmentation"] == pytest.approx(1 - largest / free if free else 0.0)

    @invariant()
    def contents_survive(self) -> None:
        for blk, payload in self.expected.items():
            raw = blk.raw()
            np.testing.assert_array_equal(_read(raw), payload)
            if blk.nbytes:
                assert _address(raw) % ALIGN == 0


def _case(name: str, **attrs):
    machine = type(name, (PoolMachine,), attrs)
    case = machine.TestCase
    case.settings = settings(max_examples=20, stateful_step_count=35, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
    return case


TestNumpyPool = _case("NumpyPool", device="numpy")
TestNumpyPoolAutoDefrag = _case("NumpyPoolAutoDefrag", device="numpy", defrag=True)
TestTorchPool = _case("TorchPool", device="cpu")
TestTorchPoolAutoDefrag = _case("TorchPoolAutoDefrag", device="cpu", defrag=True)
TestNaiveAllocator = _case("NaiveMachine", device="numpy", cls=NaiveAllocator)
