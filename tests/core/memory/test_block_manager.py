"""BlockManager and prefix cache: block tables, slots, copy-on-write forks, prefix
reuse with reference counts, LRU eviction, and all-or-nothing failures.

The state machine keeps a stand-in KV cache ([num_blocks * block_size] ints) written
through the slots the manager hands out, exactly as ReshapeAndCache would write keys.
Like a real key, the value stored for position p depends on every token up to p
(a hash of the prefix). After every step, reading each sequence back through its
block table must give its own values: a wrong prefix hit (same tokens, other
context), a missed copy-on-write or a block handed out twice shows up."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from atbcore.errors import InputError, ParamsError, PoolExhaustedError
from atbcore.memory.block_manager import BlockManager, NoFreeBlocksError
from atbcore.memory.prefix import block_hash


def test_block_hash_depends_on_tokens_and_prefix():
    a = block_hash(None, [1, 2, 3, 4])
    assert a == block_hash(None, [1, 2, 3, 4]) and len(a) == 16
    assert a != block_hash(None, [1, 2, 3, 5])
    assert block_hash(a, [5, 6]) != block_hash(block_hash(None, [9, 9, 9, 9]), [5, 6])
    assert block_hash(None, [1]) != block_hash(None, [1], extra=b"lora-1")


def test_params_and_errors_are_checked():
    with pytest.raises(ParamsError, match="block_size"):
        BlockManager(8, 0)
    bm = BlockManager(4, 4)
    with pytest.raises(InputError, match="prompt length"):
        bm.allocate("a")
    with pytest.raises(InputError, match="prompt length"):
        bm.allocate("a", [1, 2], num_tokens=3)
    bm.allocate("a", num_tokens=5)
    with pytest.raises(InputError, match="already allocated"):
        bm.allocate("a", num_tokens=1)
    with pytest.raises(InputError, match="unknown sequence"):
        bm.free("zz")
    with pytest.raises(InputError, match="fork target"):
        bm.fork("a", "a")
    with pytest.raises(InputError, match="slot range"):
        bm.slots("a", 3, 9)


def test_tables_slots_and_growth():
    bm = BlockManager(8, 4)
    assert bm.allocate("a", num_tokens=6) == 0
    ta = bm.block_table("a")
    assert len(ta) == 2
    assert bm.slots("a") == [ta[0] * 4 + i for i in range(4)] + [ta[1] * 4, ta[1] * 4 + 1]
    slots, copies = bm.append_slots("a", 3)
    assert copies == [] and len(bm.block_table("a")) == 3
    ta = bm.block_table("a")
    assert slots == [ta[1] * 4 + 2, ta[1] * 4 + 3, ta[2] * 4]
    assert bm.num_free_blocks == 5 and bm.stats()["waste_slots"] == 3
    bm.free("a")
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0
    bm.check()


def test_out_of_blocks_changes_nothing_and_recovers():
    bm = BlockManager(4, 4)
    bm.allocate("a", num_tokens=12)
    before = (bm.block_table("a"), bm.stats())
    with pytest.raises(NoFreeBlocksError) as e:
        bm.allocate("b", num_tokens=5)
    assert isinstance(e.value, PoolExhaustedError)
    for frag in ("BlockManager", "'b'", "num_blocks=4", "free=1", "2 free blocks"):
        assert frag in str(e.value)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate_batch(["b", "c"], num_tokens=[4, 4])  # 2 needed, 1 free: neither
    assert "b" not in bm and "c" not in bm
    bm.append_slots("a", 4)  # takes the last block
    with pytest.raises(NoFreeBlocksError, match="append"):
        bm.append_slots("a", 1)
    assert bm.num_tokens("a") == 16 and (bm.block_table("a")[:3], ) == (before[0], )
    bm.check()
    bm.free("a")  # the caller preempts "a"; "b" now fits
    assert bm.allocate("b", num_tokens=5) == 0
    bm.check()


def test_fork_shares_blocks_and_copies_on_write():
    bm = BlockManager(8, 4)
    bm.allocate("p", num_tokens=6)  # blocks P0 (full) and P1 (2 of 4)
    p0, p1 = bm.block_table("p")
    bm.fork("p", "c")
    assert bm.block_table("c") == [p0, p1] and bm.ref_count(p0) == bm.ref_count(p1) == 2
    slots, copies = bm.append_slots("c", 1)
    new = bm.block_table("c")[1]
    assert copies == [(p1, new)] and new != p1 and slots == [new * 4 + 2]
    assert bm.ref_count(p1) == 1 and bm.ref_count(p0) == 2
    slots, copies = bm.append_slots("p", 1)  # p is the sole owner of p1 now: in place
    assert copies == [] and slots == [p1 * 4 + 2]
    bm.fork("p", "d")
    slots, copies = bm.append_slots_batch(["p", "d"], 1)
    # p copies first; d is then the only holder of p1 and writes in place.
    assert len(copies) == 1 and copies[0][0] == p1 and bm.block_table("d")[1] == p1
    bm.check()
    for s in ("p", "c", "d"):
        bm.free(s)
    assert bm.num_free_blocks == 8
    bm.check()


def test_prefix_reuse_refcounts_and_lru_eviction():
    bm = BlockManager(6, 4, enable_prefix_caching=True)
    prompt = list(range(10))  # blocks [0..3] [4..7] and a partial [8, 9]
    assert bm.allocate("a", prompt) == 0
    assert bm.mark_computed("a") == 2
    assert bm.allocate("b", prompt[:8] + [42, 43, 44]) == 8  # both full blocks hit
    a, b = bm.block_table("a"), bm.block_table("b")
    assert b[:2] == a[:2] and b[2] != a[2] and bm.ref_count(a[0]) == 2
    st_ = bm.stats()["prefix"]
    assert st_["hit_tokens"] == 8 and st_["lookup_tokens"] == 21 and st_["hit_blocks"] == 2
    assert bm.computed_tokens == 10 + 3
    # A prompt made only of cached blocks still computes its last block.
    assert bm.allocate("c", prompt[:8]) == 4
    bm.free("a")
    bm.free("b")
    bm.free("c")
    assert bm.prefix.num_idle == 2 and bm.num_free_blocks == 6
    # Idle cached blocks are reused after a free ...
    assert bm.allocate("d", prompt) == 8
    bm.free("d")
    # ... and evicted least recently used first (the tail block before the head) when
    # fresh blocks run out.
    head, tail = a[0], a[1]
    bm.allocate("e", num_tokens=17)  # 5 blocks: 4 free + 1 evicted
    assert bm.prefix.evictions == 1 and bm.prefix.is_cached(head) and not bm.prefix.is_cached(tail)
    bm.free("e")
    assert bm.allocate("f", prompt) == 4  # only the head block survives
    bm.check()


def test_prefix_blocks_are_offered_only_when_computed():
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    bm.allocate("a", [1, 2, 3, 4, 5])
    assert bm.allocate("b", [1, 2, 3, 4, 5]) == 0  # "a" not computed yet: no hit
    bm.free("a")  # freed before being computed: its blocks are simply free again
    assert bm.prefix.num_cached == 0 and bm.num_free_blocks == 5
    bm.mark_computed("b")
    slots, _ = bm.append_slots("b", 1, [6])  # fills block 3: offered at the next mark
    bm.mark_computed("b")
    assert bm.allocate("c", [1, 2, 3, 4, 5, 6, 7]) == 6


def test_batch_allocation_claims_hits_before_evicting():
    bm = BlockManager(6, 2, enable_prefix_caching=True)
    for sid, prompt in (("a", [1, 2, 3, 4]), ("b", [7, 7]), ("c", [8, 8])):
        bm.allocate(sid, prompt + [0])
        bm.mark_computed(sid)
        bm.free(sid)
    # idle (LRU first): [3,4] [1,2] [7,7] [8,8]; 2 blocks free.
    assert bm.prefix.num_idle == 4 and bm.num_free_blocks == 6
    # "x" needs 3 fresh blocks and would evict [3,4] first if it went alone; "y" reuses
    # [1,2] [3,4]. Claiming the hits first makes "x" evict [7,7] instead.
    cached = bm.allocate_batch(["x", "y"], [[9] * 5, [1, 2, 3, 4, 6]])
    assert cached == [0, 4] and bm.prefix.evictions == 2
    bm.check()


def _kv(tokens: list[int]) -> list[int]:
    """Stand-in keys: position p's value depends on tokens[0..p] (as attention KV does)."""
    out, h = [], 17
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
        out.append(h)
    return out


class BlockMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / mark_computed against a token cache."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(12, 3, enable_prefix_caching=True)
        self.cache = np.full(12 * 3, -1, dtype=np.int64)
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    def _write(self, slots, tokens, start) -> None:
        self.cache[np.asarray(slots, dtype=np.int64)] = _kv(tokens)[start:]

    def _snapshot(self):
        return {s: self.bm.block_table(s) for s in self.tokens}, self.bm.num_free_blocks

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=10))
    def allocate(self, prompt) -> None:
        sid, before = self.next_id, self._snapshot()
        self.next_id += 1
        try:
            cached = self.bm.allocate(sid, prompt)
        except NoFreeBlocksError:
            assert self._snapshot() == before and sid not in self.bm
            return
        assert cached % 3 == 0 and cached < len(prompt)
        # Tokens served from the cache must already be there.
        got = self.cache[self.bm.slots(sid, 0, cached)]
        assert got.tolist() == _kv(prompt)[:cached]
        self._write(self.bm.slots(sid, cached, len(prompt)), prompt, cached)
        self.tokens[sid] = list(prompt)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def append(self, data, new) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        before = self._snapshot()
        try:
            slots, copies = self.bm.append_slots(sid, len(new), new)
        except NoFreeBlocksError:
            assert self._snapshot() == before
            return
        for src, dst in copies:
            self.cache[dst * 3:(dst + 1) * 3] = self.cache[src * 3:(src + 1) * 3]
        self.tokens[sid] += new
        self._write(slots, self.tokens[sid], len(self.tokens[sid]) - len(new))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child, self.next_id = self.next_id, self.next_id + 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(sid)
        del self.tokens[sid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def mark_computed(self, data) -> None:
        self.bm.mark_computed(data.draw(st.sampled_from(sorted(self.tokens))))

    @invariant()
    def every_sequence_reads_its_own_tokens(self) -> None:
        self.bm.check()
        for sid, toks in self.tokens.items():
            assert self.cache[self.bm.slots(sid)].tolist() == _kv(toks), sid
        s = self.bm.stats()
        assert s["filled_slots"] + s["waste_slots"] == s["used_blocks"] * 3
        assert s["free_blocks"] + s["prefix"]["idle_blocks"] + s["used_blocks"] == 12


TestBlockMachine = BlockMachine.TestCase
TestBlockMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
