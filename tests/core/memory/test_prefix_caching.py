"""Prefix caching end to end on a tiny causal LM whose attention runs through the
atb ops (ReshapeAndCache + PagedAttention over a PagedKVCache): a second request
sharing a 1,000-token prefix computes that prefix zero times and produces the same
logits as without caching, and as a dense NumPy forward of the whole sequence."""

from __future__ import annotations

import numpy as np
import torch

import atbcore as atb
from atbcore.memory.paged import PagedKVCache
from atbcore.numerics import assert_close

V, HID, LAYERS, H, HKV, D, BS = 64, 32, 2, 4, 2, 8, 8


class TinyLM:
    """Embedding (NumPy) -> [RmsNorm, q/k/v projections, paged attention (RoPE-free,
    causal), output projection, residual, SiLU MLP, residual] x LAYERS -> RmsNorm ->
    LM head. ``tokens_computed`` counts tokens run through the layers."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)

        def w(*shape, scale=0.2):
            return (rng.standard_normal(shape) * scale).astype(np.float32)

        self.emb = w(V, HID, scale=1.0)
        self.layers = [dict(n1=1 + w(HID, scale=0.1), wq=w(H * D, HID), wk=w(HKV * D, HID),
                            wv=w(HKV * D, HID), wo=w(HID, H * D), n2=1 + w(HID, scale=0.1),
                            w1=w(2 * HID, HID), w2=w(HID, 2 * HID)) for _ in range(LAYERS)]
        self.norm, self.head = 1 + w(HID, scale=0.1), w(V, HID)
        b = atb.Builder()
        self.rms = b.build_operation("RmsNorm", {"eps": 1e-6})
        self.attn = b.build_operation("PagedAttention", {"num_heads": H, "num_kv_heads": HKV,
                                                         "causal": True})
        self.tokens_computed = 0

    def forward(self, cache: PagedKVCache, batch, new_tokens: list[int]) -> np.ndarray:
        """Logits [B, V] of each sequence's last token; only ``new_tokens`` are computed."""
        t = torch.from_numpy
        x = t(self.emb[np.asarray(new_tokens)])  # [T, HID]
        self.tokens_computed += len(new_tokens)
        for i, p in enumerate(self.layers):
            h = self.rms.execute([x, t(p["n1"])])[0]
            q = (h @ t(p["wq"]).T).reshape(-1, H, D)  # [T, H, D]
            k = (h @ t(p["wk"]).T).reshape(-1, HKV, D)
            v = (h @ t(p["wv"]).T).reshape(-1, HKV, D)
            cache.write(i, k, v, batch.slot_mapping)
            a = self.attn.execute([q, cache.key_cache(i), cache.value_cache(i), batch.block_tables,
                                   batch.context_lens, batch.q_seq_lens])[0]
            x = x + a.reshape(-1, H * D) @ t(p["wo"]).T
            h = self.rms.execute([x, t(p["n2"])])[0]
            x = x + torch.nn.functional.silu(h @ t(p["w1"]).T) @ t(p["w2"]).T
        last = np.cumsum(batch.q_seq_lens.numpy()) - 1
        h = self.rms.execute([x[last], t(self.norm)])[0]
        return (h @ t(self.head).T).numpy()

    def dense(self, tokens: list[int]) -> np.ndarray:
        """Independent oracle: the whole sequence in float64 NumPy, causal attention."""
        def rms(x, wt):
            return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * wt

        x = self.emb[np.asarray(tokens)].astype(np.float64)
        n = len(tokens)
        causal = np.tril(np.ones((n, n), dtype=bool))
        for p in self.layers:
            h = rms(x, p["n1"])
            q = (h @ p["wq"].T).reshape(n, H, D).transpose(1, 0, 2)  # [H, n, D]
            k = np.repeat((h @ p["wk"].T).reshape(n, HKV, D).transpose(1, 0, 2), H // HKV, 0)
            v = np.repeat((h @ p["wv"].T).reshape(n, HKV, D).transpose(1, 0, 2), H // HKV, 0)
            s = np.where(causal, q @ k.transpose(0, 2, 1) / np.sqrt(D), -np.inf)
            e = np.exp(s - s.max(-1, keepdims=True))
            a = (e / e.sum(-1, keepdims=True)) @ v  # [H, n, D]
            x = x + a.transpose(1, 0, 2).reshape(n, H * D) @ p["wo"].T
            h = rms(x, p["n2"])
            u = h @ p["w1"].T
            x = x + (u / (1 + np.exp(-u))) @ p["w2"].T
        return rms(x[-1:], self.norm) @ self.head.T


def _prompts():
    rng = np.random.default_rng(7)
    prefix = rng.integers(0, V, 1000).tolist()
    return prefix, prefix + rng.integers(0, V, 20).tolist(), prefix + rng.integers(0, V, 13).tolist()


def test_shared_prefix_is_computed_once_with_identical_logits():
    prefix, a, b = _prompts()
    model = TinyLM()
    cache = PagedKVCache(LAYERS, 300, BS, HKV, D, "fp32", enable_prefix_caching=True)

    batch = cache.prepare_prefill(["A"], [a])
    assert batch.num_cached == [0]
    logits_a = model.forward(cache, batch, a)
    cache.mark_computed(["A"])
    assert model.tokens_computed == len(a)

    batch = cache.prepare_prefill(["B"], [b])
    assert batch.num_cached == [1000]  # 125 full blocks of 8 tokens
    assert batch.q_seq_lens.tolist() == [13] and batch.positions.tolist() == list(range(1000, 1013))
    before = model.tokens_computed
    logits_b = model.forward(cache, batch, b[1000:])
    prefix_computed = model.tokens_computed - before - (len(b) - len(prefix))
    assert prefix_computed == 0
    tab_a, tab_b = cache.manager.block_table("A"), cache.manager.block_table("B")
    assert tab_b[:125] == tab_a[:125] and not set(tab_b[125:]) & set(tab_a)
    assert all(cache.manager.ref_count(blk) == 2 for blk in tab_a[:125])
    st = cache.stats()["prefix"]
    assert st["hit_tokens"] == 1000 and st["lookup_tokens"] == len(a) + len(b)
    assert cache.stats()["computed_tokens"] == len(a) + 13

    # The same request without prefix caching computes all 1,013 tokens ...
    plain_model = TinyLM()
    plain = PagedKVCache(LAYERS, 300, BS, HKV, D, "fp32")
    batch = plain.prepare_prefill(["B"], [b])
    assert batch.num_cached == [0]
    logits_plain = plain_model.forward(plain, batch, b)
    assert plain_model.tokens_computed == len(b)
    # ... and gives the same logits, which also match a dense forward of the sequence.
    assert_close(logits_b, logits_plain, "fp32", what="cached vs uncached logits")
    assert_close(logits_b, model.dense(b), "fp32", what="cached vs dense NumPy logits")
    assert_close(logits_a, model.dense(a), "fp32", what="first request vs dense NumPy logits")

    # Decoding continues identically from the shared blocks.
    nxt = int(np.argmax(logits_b[0]))
    for c, m in ((cache, model), (plain, plain_model)):
        m.last = m.forward(c, c.prepare_decode(["B"], [[nxt]]), [nxt])
    assert_close(model.last, plain_model.last, "fp32", what="decode after cached prefill")
    assert_close(model.last, model.dense(b + [nxt]), "fp32", what="decode vs dense")


def test_cached_prefix_outlives_its_requests_until_evicted():
    prefix, a, b = _prompts()
    model = TinyLM()
    cache = PagedKVCache(LAYERS, 140, BS, HKV, D, "fp32", enable_prefix_caching=True)
    batch = cache.prepare_prefill(["A"], [a])
    model.forward(cache, batch, a)
    cache.mark_computed("A")
    cache.free_sequence("A")  # no request holds the prefix now; its blocks stay cached
    assert cache.manager.prefix.num_idle == 127 and cache.manager.num_free_blocks == 140
    batch = cache.prepare_prefill(["B"], [b])
    assert batch.num_cached == [1000]
    logits = model.forward(cache, batch, b[1000:])
    assert_close(logits, model.dense(b), "fp32", what="logits from an idle cached prefix")
    cache.free_sequence("B")
    # A long unrelated request needs almost every block: the least recently used
    # cached blocks (the prefix's tail first) are evicted, never a referenced one.
    other = np.random.default_rng(3).integers(0, V, 8 * 130).tolist()
    cache.prepare_prefill(["C"], [other])
    # 13 blocks were free; 117 of the 127 cached ones go: A's own two suffix blocks
    # first, then the prefix from its tail, so its first 10 blocks survive.
    assert cache.stats()["prefix"]["evictions"] == 117 and cache.manager.prefix.num_cached == 10
    cache.free_sequence("C")
    assert cache.prepare_prefill(["D"], [b]).num_cached == [80]
