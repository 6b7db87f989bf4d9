"""KV-cache memory waste: a paged cache vs a contiguous cache sized for the longest
sequence, on a decode workload (not a timed test).

64 sequences with prompt lengths drawn (seeded) from 16..2048 are prefilled, then
decoded for a few steps, writing real keys/values through ReshapeAndCache (paged) and
in-place appends (contiguous). Reported in bytes: what each cache reserves, what the
tokens occupy, and the waste. The paged cache must waste at most one block per
sequence (exit status 1 otherwise).

    python benchmarks/kv_cache_waste.py [--device cpu] [--out bench-results/kv_cache_waste.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from atbcore.dtypes import Dtype  # noqa: E402
from atbcore.memory import MemoryPool, MemoryPoolConfig  # noqa: E402
from atbcore.memory.kv_cache import KVCache  # noqa: E402
from atbcore.memory.paged import PagedKVCache  # noqa: E402


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--device", default="cpu", help="cpu, cuda[:i], npu[:i] or numpy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-results/kv_cache_waste.json")
    return ap.parse_args()


def _rand(rng: np.random.Generator, shape: tuple[int, ...], dtype: Dtype) -> np.ndarray:
    return rng.standard_normal(shape, dtype=np.float32).astype(dtype.numpy)


def run_paged(a: argparse.Namespace, lens: np.ndarray, dtype: Dtype) -> dict:
    rng = np.random.default_rng(a.seed + 1)
    final = lens + a.decode_steps
    num_blocks = int(sum(-(-n // a.block_size) for n in final)) + a.seqs  # a little slack
    per_block = a.layers * 2 * a.block_size * a.kv_heads * a.head_dim * dtype.itemsize
    pool = MemoryPool(MemoryPoolConfig(max_size=num_blocks * per_block + (1 << 20),
                                       device=a.device))
    cache = PagedKVCache(a.layers, num_blocks, a.block_size, a.kv_heads, a.head_dim, dtype,
                         device=a.device, pool=pool)
    ids = list(range(a.seqs))
    batch = cache.prepare_prefill(ids, num_tokens=[int(n) for n in lens])
    t = batch.num_tokens
    for layer in range(a.layers):
        k = _rand(rng, (t, a.kv_heads, a.head_dim), dtype)
        cache.write(layer, k, k, batch.slot_mapping)
    for _ in range(a.decode_steps):
        batch = cache.prepare_decode(ids)
        for layer in range(a.layers):
            k = _rand(rng, (a.seqs, a.kv_heads, a.head_dim), dtype)
            cache.write(layer, k, k, batch.slot_mapping)
    s = cache.stats()
    per_token = per_block // a.block_size
    waste_per_seq = [len(cache.manager.block_table(i)) * a.block_size
                     - cache.manager.num_tokens(i) for i in ids]
    out = {"num_blocks": num_blocks, "block_size": a.block_size, "block_bytes": per_block,
           "pool_reserved_bytes": pool.stats()["reserved"], "cache_bytes": cache.nbytes,
           "used_bytes": s["used_bytes"], "token_bytes": s["token_bytes"],
           "waste_bytes": s["waste_bytes"],
           "max_waste_per_seq_bytes": max(waste_per_seq) * per_token,
           "max_waste_per_seq_blocks": max(waste_per_seq) / a.block_size}
    cache.destroy()
    return out


def run_contiguous(a: argparse.Namespace, lens: np.ndarray, dtype: Dtype) -> dict:
    rng = np.random.default_rng(a.seed + 2)
    max_len = int(lens.max()) + a.decode_steps
    nbytes = a.layers * 2 * a.seqs * max_len * a.kv_heads * a.head_dim * dtype.itemsize
    pool = MemoryPool(MemoryPoolConfig(max_size=nbytes + (1 << 20), device=a.device))
    cache = KVCache(a.layers, a.seqs, max_len, a.kv_heads, a.head_dim, dtype, device=a.device,
                    pool=pool)
    chunk = 8  # prefill a few sequences at a time to bound the host staging buffers
    for start in range(0, a.seqs, chunk):
        ids = list(range(start, min(start + chunk, a.seqs)))
        t = int(lens[ids].max())
        for layer in range(a.layers):
            k = _rand(rng, (len(ids), t, a.kv_heads, a.head_dim), dtype)
            cache.append(layer, k, k, seq_ids=ids, lengths=lens[ids])
    for _ in range(a.decode_steps):
        for layer in range(a.layers):
            k = _rand(rng, (a.seqs, 1, a.kv_heads, a.head_dim), dtype)
            cache.append(layer, k, k)
    token_bytes = cache.bytes_used()
    out = {"max_seq_len": max_len, "pool_reserved_bytes": pool.stats()["reserved"],
           "cache_bytes": cache.nbytes, "used_bytes": cache.nbytes, "token_bytes": token_bytes,
           "waste_bytes": cache.nbytes - token_bytes}
    cache.destroy()
    return out


def main() -> int:
    a = parse()
    dtype = Dtype.of(a.dtype)
    rng = np.random.default_rng(a.seed)
    lens = rng.integers(a.min_len, a.max_len + 1, size=a.seqs)
    t0 = time.perf_counter()
    paged = run_paged(a, lens, dtype)
    contiguous = run_contiguous(a, lens, dtype)
    ok = paged["max_waste_per_seq_blocks"] <= 1.0
    result = {
        "workload": {"seqs": a.seqs, "prompt_lens": lens.tolist(), "decode_steps": a.decode_steps,
                     "layers": a.layers, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
                     "dtype": dtype.name, "device": a.device, "seed": a.seed,
                     "total_tokens": int((lens + a.decode_steps).sum())},
        "paged": paged, "contiguous": contiguous,
        "paged_waste_within_one_block_per_seq": ok,
        "waste_ratio_contiguous_over_paged": contiguous["waste_bytes"] / max(paged["waste_bytes"], 1),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    mib = 1 << 20
    print(f"{a.seqs} sequences, prompts {a.min_len}..{a.max_len} (seed {a.seed}), "
          f"{a.decode_steps} decode steps, {result['workload']['total_tokens']} tokens, "
          f"{a.layers} layers x {a.kv_heads} kv heads x {a.head_dim} {dtype.name}")
    print(f"{'cache':<12}{'held B':>14}{'tokens B':>14}{'waste B':>14}{'waste %':>9}")
    for name, r in (("paged", paged), ("contiguous", contiguous)):
        print(f"{name:<12}{r['used_bytes']:>14}{r['token_bytes']:>14}{r['waste_bytes']:>14}"
              f"{100 * r['waste_bytes'] / r['used_bytes']:>8.1f}%")
    print(f"paged: block {a.block_size} tokens = {paged['block_bytes']} B; worst sequence "
          f"wastes {paged['max_waste_per_seq_bytes']} B "
          f"({paged['max_waste_per_seq_blocks']:.3f} block) -> "
          f"{'OK' if ok else 'FAIL'} (<= 1 block per sequence)")
    print(f"contiguous sized for {contiguous['max_seq_len']} tokens: "
          f"{contiguous['cache_bytes'] / mib:.1f} MiB vs paged in use "
          f"{paged['used_bytes'] / mib:.1f} MiB; wrote {a.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
