"""MemoryPool: best fit, splitting/coalescing, alignment, growth, defragmentation,
typed views, statistics, exhaustion and every misuse error, threads."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from atbcore.dtypes import Dtype
from atbcore.errors import DeviceError, MemoryError_, ParamsError, PoolExhaustedError
from atbcore.memory.config import MemoryPoolConfig
from atbcore.memory.naive import NaiveAllocator
from atbcore.memory.pool import Block, MemoryPool
from atbcore.tensor import to_numpy

DEVICES = ["cpu", "numpy"]


def make(device="numpy", **kw) -> MemoryPool:
    kw.setdefault("max_size", 1 << 16)
    kw.setdefault("initial_size", 4096)
    return MemoryPool(MemoryPoolConfig(device=device, **kw))


def fill(blk: Block, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, blk.nbytes, dtype=np.uint8)
    to_numpy(blk.raw())[:] = data
    return data


def content(blk: Block) -> np.ndarray:
    return to_numpy(blk.raw()).copy()


@pytest.mark.parametrize("kw, fragment", [
    ({"max_size": 0}, "max_size"),
    ({"max_size": 1024, "growth_factor": 0.5}, "growth_factor"),
    ({"max_size": 1024, "alignment": 48}, "alignment"),
    ({"max_size": 1024, "alignment": 32}, "alignment"),
    ({"max_size": 1024, "initial_size": 4096}, "initial_size"),
    ({"max_size": 1.5}, "max_size"),
])
def test_config_is_validated(kw, fragment):
    with pytest.raises(ParamsError, match=fragment) as e:
        MemoryPoolConfig(**kw)
    assert "MemoryPoolConfig" in str(e.value)


@pytest.mark.parametrize("bad", [-1, 1.5, "8", True, None])
def test_alloc_size_is_validated(bad):
    pool = make()
    with pytest.raises(ParamsError, match="alloc size"):
        pool.alloc(bad)
    assert pool.stats()["num_blocks"] == 0


def test_bad_devices_are_refused():
    with pytest.raises(DeviceError, match="MemoryPool"):
        MemoryPool(MemoryPoolConfig(max_size=4096, device="nonsense"))
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="not available"):
            MemoryPool(MemoryPoolConfig(max_size=4096, device="cuda"))


@pytest.mark.parametrize("device", DEVICES)
def test_typed_views_alias_the_block(device):
    pool = make(device)
    blk = pool.alloc(1024)
    f32 = blk.tensor((4, 8), Dtype.FP32)
    native = torch.Tensor if device == "cpu" else np.ndarray
    assert isinstance(f32, native) and tuple(f32.shape) == (4, 8)
    f32[:] = 2.5
    # The same bytes read back as uint8 through another view: 2.5f = 0x40200000 (LE).
    raw = to_numpy(blk.view(0, (8,), "uint8"))
    np.testing.assert_array_equal(raw, [0, 0, 0x20, 0x40] * 2)
    bf = blk.view(128, (16,), Dtype.BF16)
    bf[:] = 1.0
    assert to_numpy(bf).astype(np.float32).tolist() == [1.0] * 16
    assert to_numpy(blk.tensor((4, 8), "fp32")).sum() == 2.5 * 32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("alignment", [64, 256])
def test_alignment_of_offsets_and_addresses(device, alignment):
    pool = make(device, alignment=alignment, initial_size=8192)
    blocks = [pool.alloc(n) for n in (1, 63, 65, 100, 300, 7)]
    for b in blocks:
        _, off = b.location
        assert off % alignment == 0 and b.size % alignment == 0 and b.size >= b.nbytes
        t = b.raw()
        addr = t.data_ptr() if device == "cpu" else t.ctypes.data
        assert addr % alignment == 0


def test_best_fit_picks_the_smallest_hole_and_splits_it():
    pool = make(initial_size=8192)
    a, h1, b, h2, c, h3, d = (pool.alloc(n) for n in (64, 512, 64, 128, 64, 256, 64))
    for h in (h1, h2, h3):
        h.free()
    blk = pool.alloc(100)  # 128 after alignment: exactly the 128-byte hole
    assert blk.location[1] == 64 + 512 + 64
    blk2 = pool.alloc(200)  # 256: the 256 hole, not the 512 one
    assert blk2.location[1] == 64 + 512 + 64 + 128 + 64
    blk3 = pool.alloc(64)  # split of the 512 hole: its first 64 bytes
    assert blk3.location[1] == 64
    assert (64 + 64, 448) in pool.layout()[0]["free"]


def test_freeing_neighbours_coalesces():
    pool = make(initial_size=4096, release_threshold=None)  # the emptied arena stays
    blocks = [pool.alloc(512) for _ in range(8)]
    for i in (1, 3, 2):
        blocks[i].free()
    assert pool.layout()[0]["free"] == [(512, 1536)]
    for b in blocks[:1] + blocks[4:]:
        b.free()
    assert pool.layout()[0]["free"] == [(0, 4096)]
    assert pool.stats()["largest_free_block"] == 4096


def test_arenas_grow_by_the_growth_factor_up_to_max_size():
    pool = make(max_size=20000, initial_size=4096, growth_factor=1.5)
    pool.alloc(4096)
    pool.alloc(4096)   # new arena of 6144
    pool.alloc(6144)   # new arena of 9216 (reserved 19456 of 20000)
    sizes = [a["size"] for a in pool.layout()]
    assert sizes == [4096, 6144, 9216]
    assert pool.stats()["largest_free_block"] == 3072
    with pytest.raises(PoolExhaustedError):
        pool.alloc(4000)  # no hole holds it and only 544 bytes are left to grow
    pool2 = make(max_size=12000, initial_size=4096, growth_factor=2.0)
    pool2.alloc(4096)
    pool2.alloc(100)   # 8192 wanted, capped to what max_size leaves (7904 -> 7872 aligned)
    assert [a["size"] for a in pool2.layout()] == [4096, 7872]
    assert pool2.stats()["reserved"] <= 12000


def test_exhaustion_reports_stats_and_pool_recovers():
    pool = make(max_size=8192, initial_size=8192)
    blocks = [pool.alloc(2048) for _ in range(4)]
    before = pool.stats()
    with pytest.raises(PoolExhaustedError) as e:
        pool.alloc(100)
    msg = str(e.value)
    for frag in ("MemoryPool", "reserved=8192", "allocated=8192", "largest_free_block=0",
                 "max_size=8192", "fragmentation="):
        assert frag in msg
    after = pool.stats()
    assert {k: v for k, v in after.items() if k != "failed_allocs"} == \
        {k: v for k, v in before.items() if k != "failed_allocs"}
    assert after["failed_allocs"] == 1
    blocks[2].free()
    again = pool.alloc(2000)
    assert again.location == (pool.layout()[0]["id"], 4096)
    with pytest.raises(PoolExhaustedError, match="max_size"):
        pool.alloc(1 << 20)  # larger than the whole pool


@pytest.mark.parametrize("device", DEVICES)
def test_defragment_keeps_contents_and_handles(device):
    pool = make(device, max_size=8192, initial_size=8192, growth_factor=1.0)
    blocks = [pool.alloc(1000) for _ in range(8)]
    data = {b: fill(b, i) for i, b in enumerate(blocks)}
    for b in blocks[::2]:
        b.free()
        del data[b]
    pinned = blocks[5].pin()
    pinned_loc = pinned.location
    with pytest.raises(PoolExhaustedError):
        pool.alloc(2048)  # 4 KiB free, but in 1 KiB holes and defrag is off
    report = pool.defragment()
    # 1 -> 0, 3 -> 1024, and 7 jumps the pinned block into the 2 KiB hole at 2048.
    assert report["moved_blocks"] == 3 and report["moved_bytes"] == 3000
    assert pinned.location == pinned_loc
    assert [blocks[i].location[1] for i in (1, 3, 7)] == [0, 1024, 2048]
    assert blocks[1].version == 1 and blocks[7].version == 1 and pinned.version == 0
    for b, d in data.items():
        np.testing.assert_array_equal(content(b), d)
    big = pool.alloc(2048)  # the hole left of the pinned block now holds it
    assert big.location[1] == 3072
    pinned.unpin()


def test_enable_defrag_compacts_before_failing():
    for defrag in (False, True):
        pool = make(max_size=8192, initial_size=8192, enable_defrag=defrag)
        blocks = [pool.alloc(1024) for _ in range(8)]
        data = {b: fill(b, i) for i, b in enumerate(blocks)}
        for b in blocks[::2]:
            b.free()
            del data[b]
        if not defrag:
            with pytest.raises(PoolExhaustedError):
                pool.alloc(4096)
            continue
        big = pool.alloc(4096)
        assert big.location[1] == 4096 and pool.stats()["defrag_count"] == 1
        for b, d in data.items():
            np.testing.assert_array_equal(content(b), d)


def test_defragment_empties_later_arenas_and_release():
    pool = make(max_size=1 << 16, initial_size=4096, growth_factor=1.0, release_threshold=None)
    a = [pool.alloc(2048) for _ in range(4)]  # arena A: a0 a1, arena B: a2 a3
    data = {b: fill(b, i) for i, b in enumerate(a)}
    arena_a = a[0].location[0]
    for i in (1, 2):
        a[i].free()
        del data[a[i]]
    assert pool.release() == 0  # both arenas still hold a block
    report = pool.defragment()
    assert report == {"moved_blocks": 2, "moved_bytes": 4096, "released_bytes": 4096}
    assert a[3].location == (arena_a, 2048) and a[0].location == (arena_a, 0)
    assert pool.stats()["num_arenas"] == 1 and pool.stats()["reserved"] == 4096
    for blk, d in data.items():
        np.testing.assert_array_equal(content(blk), d)
    a[3].free()
    a[0].free()
    assert pool.release() == 4096 and pool.stats()["reserved"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_double_free_foreign_and_use_after_free(device):
    pool, other = make(device), make(device)
    blk, keep = pool.alloc(256), pool.alloc(256)
    mine = fill(keep, 3)
    blk.free()
    layout, stats = pool.layout(), pool.stats()
    with pytest.raises(MemoryError_, match="double free") as e:
        blk.free()
    assert "MemoryPool" in str(e.value) and f"#{blk.id}" in str(e.value)
    with pytest.raises(MemoryError_, match="double free"):
        pool.free(blk)
    for use in (lambda: blk.raw(), lambda: blk.tensor((4,), "fp32"), lambda: blk.location,
                lambda: blk.view(0, (1,), "uint8"), lambda: blk.pin()):
        with pytest.raises(MemoryError_, match="freed block"):
            use()
    foreign = other.alloc(256)
    with pytest.raises(MemoryError_, match="foreign"):
        pool.free(foreign)
    with pytest.raises(MemoryError_, match="not a Block"):
        pool.free("block")
    assert not foreign.freed
    assert pool.layout() == layout and pool.stats() == stats
    np.testing.assert_array_equal(content(keep), mine)
    foreign.free()
    assert other.stats()["allocated"] == 0


def test_views_outside_the_block_are_refused():
    pool = make()
    blk = pool.alloc(100)
    with pytest.raises(MemoryError_, match="outside the block"):
        blk.view(0, (26,), "fp32")  # 104 > 100 requested bytes
    with pytest.raises(MemoryError_, match="outside the block"):
        blk.view(2, (4,), "fp32")  # misaligned for fp32
    with pytest.raises(MemoryError_, match="outside the block"):
        blk.view(-4, (1,), "fp32")
    assert blk.view(96, (1,), "fp32").shape == (1,)


def test_stats_track_counts_peak_and_fragmentation():
    pool = make(initial_size=4096, release_threshold=None)  # holes in a kept arena
    a, b, c = pool.alloc(1024), pool.alloc(1000), pool.alloc(2048)
    s = pool.stats()
    assert (s["allocated"], s["requested"], s["reserved"]) == (4096, 4072, 4096)
    b.free()
    a.free()
    c.free()
    s = pool.stats()
    assert s["alloc_count"] == 3 and s["free_count"] == 3 and s["peak"] == 4096
    assert s["allocated"] == 0 and s["fragmentation"] == 0.0
    x, y, z = pool.alloc(1024), pool.alloc(1024), pool.alloc(2048)
    y.free()
    z.free()
    x.free()
    w = pool.alloc(1024)
    v = pool.alloc(64)  # holes: after w, v: [1088, 4096) contiguous -> frag 0
    assert pool.stats()["fragmentation"] == 0.0
    w.free()  # holes: [0,1024) and [1088,4096): largest 3008 of 4032 free
    s = pool.stats()
    assert s["largest_free_block"] == 3008
    assert s["fragmentation"] == pytest.approx(1 - 3008 / 4032)
    v.free()


def test_block_context_manager_frees():
    pool = make()
    with pool.alloc(128) as blk:
        assert pool.stats()["num_blocks"] == 1
    assert blk.freed and pool.stats()["allocated"] == 0


def test_naive_allocator_gives_every_block_its_own_buffer():
    pool = NaiveAllocator(MemoryPoolConfig(max_size=4096, device="numpy"))
    a, b = pool.alloc(100), pool.alloc(1000)
    s = pool.stats()
    assert s["allocator"] == "naive" and s["num_arenas"] == 2 and s["reserved"] == 128 + 1024
    with pytest.raises(PoolExhaustedError, match="max_size"):
        pool.alloc(4000)
    a.free()
    assert pool.stats()["reserved"] == 1024 and pool.stats()["num_arenas"] == 1
    with pytest.raises(MemoryError_, match="double free"):
        a.free()
    assert pool.defragment()["moved_blocks"] == 0
    b.free()
    assert pool.stats()["reserved"] == 0


@pytest.mark.parametrize("device", DEVICES)
def test_threads_keep_the_invariants(device):
    pool = make(device, max_size=1 << 18, initial_size=8192, enable_defrag=True)
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        mine: list[tuple[Block, np.ndarray]] = []
        try:
            for _ in range(150):
                if mine and rng.random() < 0.45:
                    blk, data = mine.pop(int(rng.integers(len(mine))))
                    blk.pin()  # pinned: a concurrent defragment cannot move it under the view
                    np.testing.assert_array_equal(content(blk), data)
                    blk.free()
                else:
                    try:
                        blk = pool.alloc(int(rng.integers(1, 3000)), pinned=True)
                    except PoolExhaustedError:
                        continue
                    data = fill(blk, int(rng.integers(1 << 30)))
                    blk.unpin()
                    mine.append((blk, data))
            for blk, data in mine:
                blk.pin()
                np.testing.assert_array_equal(content(blk), data)
                blk.free()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    def defragmenter() -> None:
        while not stop.is_set():
            pool.defragment()
            time.sleep(0.0005)  # let workers take the lock between compactions

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    d = threading.Thread(target=defragmenter)
    d.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    d.join()
    assert not errors, errors[0]
    s = pool.stats()
    assert s["allocated"] == 0 and s["num_blocks"] == 0
    assert s["alloc_count"] == s["free_count"] > 0
    assert s["defrag_count"] > 0
    for a in pool.layout():
        assert a["free"] == [(0, a["size"])]
