"""The paged path's fast pieces: ``DecodeKV`` (the batch's KV kept across decode
steps) against the NumPy reference of PagedAttention over the same paged cache,
through every reason to rebuild it (cache edits, batch changes, capacity, its memory
bound); and ``forward_paged`` (packed prefill, kept-KV decode, the gathering kernel
after a prefix hit) against Hugging Face's forward on each sequence alone."""

import numpy as np
import pytest
import torch

from atbcore.memory import PagedKVCache
from atbcore.numerics import assert_close
from atbcore.ops.registry import get_op
from atb_torch.models import ModelRunner
from atb_torch.models.decode_kv import DecodeKV
from atb_torch.models.kernels import Kern
from tiny_models import tiny

L, HKV, H, D, BS = 2, 2, 4, 16, 4


def _rand(*shape, g):
    return torch.randn(*shape, generator=g)


def _reference(cache, layer, q, batch, window):
    """PagedAttention's NumPy reference over the cache's blocks."""
    op = get_op("PagedAttention")
    p = op.make_params({"num_heads": H, "num_kv_heads": HKV, "window": window, "scale": 0.3})
    ins = {"query": q.numpy(), "key_cache": cache.key_cache(layer).numpy(),
           "value_cache": cache.value_cache(layer).numpy(),
           "block_tables": batch.block_tables.numpy(), "context_lens": batch.context_lens.numpy(),
           "q_seq_lens": None}
    return torch.from_numpy(op.reference(p, ins)[0])


class _Driver:
    """Decode steps over a PagedKVCache the way forward_paged runs them: new k/v go
    into the blocks through ReshapeAndCache (no version bump), then DecodeKV attends."""

    def __init__(self, lens, window=None, num_blocks=128):
        self.g = torch.Generator().manual_seed(0)
        self.cache = PagedKVCache(L, num_blocks=num_blocks, block_size=BS, num_kv_heads=HKV,
                                  head_dim=D, dtype="fp32")
        self.ids = [f"s{i}" for i in range(len(lens))]
        batch = self.cache.prepare_prefill(self.ids, num_tokens=lens)
        for layer in range(L):  # the prompts' keys/values
            t = sum(lens)
            self.cache.write(layer, _rand(t, HKV, D, g=self.g), _rand(t, HKV, D, g=self.g),
                             batch.slot_mapping)
        self.dk = DecodeKV(L, HKV, D, torch.float32, "cpu")
        self.rac = Kern("ReshapeAndCache")
        self.window = window

    def step(self):
        batch = self.cache.prepare_decode(self.ids, num_tokens=1)
        lens = batch.context_lens.tolist()
        st = self.dk.begin(self.cache, batch, lens)
        b = len(self.ids)
        for layer in range(L):
            k, v = _rand(b, HKV, D, g=self.g), _rand(b, HKV, D, g=self.g)
            kc, vc = self.cache.key_cache(layer), self.cache.value_cache(layer)
            self.rac(key=k, value=v, key_cache=kc, value_cache=vc, slot_mapping=batch.slot_mapping)
            q = _rand(b, H, D, g=self.g)
            got = st.attend(layer, q, k, v, kc, vc, 0.3, self.window)
            assert_close(got, _reference(self.cache, layer, q, batch, self.window), "fp32",
                         f"layer {layer}, lens {lens}")
        return st


@pytest.mark.parametrize("window", [None, 3])
def test_kept_kv_matches_reference_and_rebuilds_when_it_must(window):
    d = _Driver([5, 9, 2, 13], window)
    for _ in range(3):  # first step rebuilds (prefill wrote the cache), then appends
        d.step()
    assert d.dk.rebuilds == 1
    # an edit of an existing slot through the cache bumps its version: rebuilt, and the
    # new values are the ones attended (the reference reads the cache)
    slot = torch.tensor(d.cache.manager.slots("s1", 2, 3), dtype=torch.int32)
    d.cache.write(0, torch.full((1, HKV, D), 3.0), torch.full((1, HKV, D), -2.0), slot)
    d.step()
    assert d.dk.rebuilds == 2
    d.step()
    assert d.dk.rebuilds == 2
    d.cache.free_sequence("s2")  # the batch changes
    d.ids.remove("s2")
    d.step()
    assert d.dk.rebuilds == 3
    d.ids.reverse()  # same sequences, another order
    d.step()
    assert d.dk.rebuilds == 4


def test_capacity_growth_rebuilds():
    d = _Driver([3, 6])
    cap = d.step().buf.shape[4]
    steps = cap - 6  # s1 reaches the capacity after this many more tokens
    for _ in range(steps):
        st = d.step()
    assert d.dk.rebuilds == 2 and st.buf.shape[4] > cap


def test_memory_bound_falls_back():
    cache = PagedKVCache(L, num_blocks=6, block_size=BS, num_kv_heads=HKV, head_dim=D,
                         dtype="fp32")
    batch = cache.prepare_prefill(["a", "b"], num_tokens=[5, 7])
    batch = cache.prepare_decode(["a", "b"], num_tokens=1)
    dk = DecodeKV(L, HKV, D, torch.float32, "cpu")
    # the kept copy (capacity >= 64 tokens per row) would pass half the cache's bytes
    assert dk.begin(cache, batch, batch.context_lens.tolist()) is None and dk.buf is None


@pytest.fixture(scope="module")
def llama():
    return tiny("llama")


def _hf_last_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("kept", [False, True], ids=["c-paged", "kept-kv"])
@pytest.mark.parametrize("prefix", [False, True])
def test_forward_paged_matches_hf_per_sequence(llama, prefix, kept, monkeypatch):
    """Packed prefill (or, after a prefix-cache hit, the gathering kernel), then
    decode steps (on the CPU the C PagedAttention kernel reads the blocks; the kept
    KV copy serves where it cannot, forced here), sequences leaving midway: logits
    equal HF's on each sequence alone."""
    from atb_torch.models import runner_paged

    if kept:
        monkeypatch.setattr(runner_paged, "c_paged_decode", lambda cache, spec: False)
    r = ModelRunner.from_hf(llama, opt_level=2)
    s = r.spec
    cache = PagedKVCache(s.num_layers, num_blocks=256, block_size=BS, num_kv_heads=s.num_kv_heads,
                         head_dim=s.head_dim, dtype="fp32", enable_prefix_caching=prefix)
    g = torch.Generator().manual_seed(3)
    toks = {n: torch.randint(3, 256, (k,), generator=g).tolist()
            for n, k in (("a", 7), ("b", 13), ("c", 3))}
    if prefix:  # "b" shares a block-aligned prefix with an earlier sequence
        toks["b"][:8] = toks["a"][:7] + [9]
        warm = cache.prepare_prefill(["w"], [toks["b"][:9]])
        r.forward_paged(torch.tensor(toks["b"][:9]), warm, cache)
        cache.mark_computed(["w"])
    ids = ["a", "b", "c"]
    batch = cache.prepare_prefill(ids, [toks[i] for i in ids])
    assert (sum(batch.num_cached) > 0) == prefix
    new = [t for i, c in zip(ids, batch.num_cached) for t in toks[i][c:]]
    logits = r.forward_paged(torch.tensor(new), batch, cache)
    cache.mark_computed(ids)
    for step in range(6):
        for i, row in zip(ids, logits):
            assert_close(row, _hf_last_logits(llama, toks[i]), "fp32", f"step {step} seq {i}")
        nxt = logits.argmax(-1).tolist()
        for i, t in zip(ids, nxt):
            toks[i].append(t)
        if step == 3:  # "c" finishes
            cache.free_sequence("c")
            ids, nxt = ids[:2], nxt[:2]
        batch = cache.prepare_decode(ids, [[t] for t in nxt])
        logits = r.forward_paged(torch.tensor(nxt), batch, cache)
        cache.mark_computed(ids)
    assert np.isfinite(logits.numpy()).all()
    if not kept:
        assert r._decode_kv is None  # the C kernel needs no copy
        assert r._paged_plan is not None and r.stats["plan_steps"] == 6  # the paged plan ran
        r.release_decode_kv()
        assert "_paged_plan" not in r.__dict__
        return
    assert r._decode_kv.rebuilds == 2  # once at the first decode step, once when "c" left
    r.release_decode_kv()  # LLM.close() does this: the kept copy's memory goes now
    assert r._decode_kv.buf is None
    batch = cache.prepare_decode(ids, [[t] for t in logits.argmax(-1).tolist()])
    r.forward_paged(logits.argmax(-1), batch, cache)  # and comes back at the next step
    assert r._decode_kv.rebuilds == 3 and r._decode_kv.buf is not None
