"""Host tensors on transparent huge pages (atbcore.memory.hugepages): placement, the
fallbacks, lifetime, and the CPU pool's arenas (the KV caches) living there."""

import gc

import pytest
import torch

from atbcore.memory import MemoryPool, MemoryPoolConfig, hugepages

THP = hugepages.available() is None


def test_small_tensors_stay_plain():
    t = hugepages.empty((100, 100), torch.float32)
    assert t.shape == (100, 100) and t.dtype == torch.float32 and t.is_contiguous()
    w = torch.randn(10, 10)
    assert hugepages.place(w) is w


@pytest.mark.skipif(not THP, reason=f"no huge pages here: {hugepages.available()}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_large_tensors_on_hugepages(dtype):
    t = hugepages.empty((1024, 3000), dtype)
    assert t.shape == (1024, 3000) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % hugepages.HUGE == 0
    t.fill_(3)
    assert on_huge(t)
    assert (t == 3).all()


@pytest.mark.skipif(not THP, reason=f"no huge pages here: {hugepages.available()}")
def test_place_copies_values_and_mapping_outlives_names():
    w = torch.randn(2048, 700)
    p = hugepages.place(w)
    assert p is not w and torch.equal(p, w) and on_huge(p)
    assert hugepages.placed(p) and not hugepages.placed(w)
    assert hugepages.place(p) is p                              # already there: no copy
    view = p[5:9]
    del p
    gc.collect()
    assert torch.equal(view, w[5:9])  # the mapping lives while a view does
    view.add_(1)
    assert torch.equal(view, w[5:9] + 1)


def test_disabled_by_env(monkeypatch):
    monkeypatch.setenv("ATB_HUGEPAGES", "0")
    assert hugepages.available() == "disabled by ATB_HUGEPAGES=0"
    t = hugepages.empty((1024, 1024), torch.float32)
    assert t.shape == (1024, 1024) and t.dtype == torch.float32
    w = torch.randn(1024, 1024)
    assert hugepages.place(w) is w


def test_thp_never_or_absent_is_a_reason(monkeypatch, tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always madvise [never]\n")
    monkeypatch.setattr(hugepages, "_THP", f)
    assert hugepages.available() == "transparent huge pages are set to never"
    monkeypatch.setattr(hugepages, "_THP", tmp_path / "missing")
    assert "no transparent huge page support" in hugepages.available()
    w = torch.randn(1024, 1024)
    assert hugepages.place(w) is w


@pytest.mark.skipif(not THP, reason=f"no huge pages here: {hugepages.available()}")
def test_cpu_pool_arenas_on_hugepages():
    """A CPU pool's arenas (the KV caches' memory) are on huge pages; values round-trip."""
    pool = MemoryPool(MemoryPoolConfig(max_size=64 << 20, initial_size=16 << 20))
    blk = pool.alloc(6 << 20)
    t = blk.tensor(((6 << 20) // 4,), "fp32")
    t.fill_(2.5)
    assert on_huge(t) and (t == 2.5).all()


def on_huge(t):
    """True once the kernel backs t's mapping with huge pages (faulted in)."""
    return hugepages.on_hugepages(t) >= hugepages.HUGE


@pytest.mark.skipif(not THP, reason=f"no huge pages here: {hugepages.available()}")
def test_arena_packs_small_tensors_in_order_on_hugepages():
    arena = hugepages.Arena(chunk_bytes=4 << 20)
    a = arena.place(torch.arange(1000, dtype=torch.float32))
    b = arena.empty((3, 5), torch.bfloat16)
    c = arena.place(torch.ones(300_000, dtype=torch.float32))   # 1.2 MB: still this chunk
    assert torch.equal(a, torch.arange(1000, dtype=torch.float32)) and (c == 1).all()
    assert b.shape == (3, 5) and b.dtype == torch.bfloat16
    assert a.data_ptr() % hugepages.HUGE == 0                   # a chunk starts aligned
    assert b.data_ptr() == a.data_ptr() + 4032                  # 4000 bytes, 64-aligned
    assert c.data_ptr() % 64 == 0 and c.data_ptr() > b.data_ptr()
    assert on_huge(a)
    big = arena.empty((3 << 20,), torch.float32)                # 12 MiB: its own chunk
    assert big.numel() == 3 << 20 and big.data_ptr() % hugepages.HUGE == 0
    d = arena.place(torch.full((2000,), 7.0))                   # the new chunk is full
    assert (d == 7).all() and not (big.data_ptr() <= d.data_ptr() < big.data_ptr() + (12 << 20))


def test_arena_without_hugepages_is_plain_torch(monkeypatch):
    monkeypatch.setenv("ATB_HUGEPAGES", "0")
    arena = hugepages.Arena()
    t = arena.place(torch.arange(10.0))
    assert torch.equal(t, torch.arange(10.0))
    assert arena.empty((2, 2), torch.int8).shape == (2, 2)


def test_a_graph_ops_panels_are_packed_into_its_own_weight_arena():
    """The weight layouts a GraphOp's layout pass prepares (the C matmul's panels) go
    into that GraphOp's arena, side by side (small weights on huge pages too, as the
    compile() runner packs them); they equal pack_panels of the weight."""
    import numpy as np
    import torch

    from atbcore.backends.cpu_kernels.torch_decode import pack_panels
    from atbcore.backends.torch import weight_layout
    from atbcore.graph import layers as L
    from atbcore.graph.graph_op import GraphOp

    # "a": 4096 x 64 fp32 = 1 MiB (under a huge page: the arena gives it huge pages);
    # "b": 24 x 4096 x 4 = 384 KiB
    op = GraphOp([L.Linear("a", out_features=4096), L.Linear("b", out_features=24)],
                 backend="torch")
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    y = op(x)
    w = op.graph.weight_map
    want = x @ torch.from_numpy(np.asarray(w["a.weight"])).T + torch.from_numpy(
        np.asarray(w["a.bias"]))
    want = want @ torch.from_numpy(np.asarray(w["b.weight"])).T + torch.from_numpy(
        np.asarray(w["b.bias"]))
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
    tiny = GraphOp([L.Linear("t", out_features=8)], backend="torch")
    tiny(x)
    assert tiny._weight_arena._used == 0  # 2 KiB of panels: left off the arena
    arena = op._weight_arena
    if hugepages.available() is None and weight_layout.panels_enabled():
        assert arena._used > 0 and hugepages.placed(arena._chunk)
        t = op._weight("a.weight", "torch", "cpu")
        assert type(t).__name__ == "PackedWeight"  # every fp32 Linear reads panels
        packed, _ = weight_layout.packed_panels(t)
        assert packed.untyped_storage().data_ptr() == arena._chunk.untyped_storage().data_ptr()
        assert torch.equal(packed, pack_panels(torch.from_numpy(np.asarray(t))))
    else:
        assert arena._used == 0
