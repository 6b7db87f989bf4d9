"""Paged decode attention (``atb_decode_attention``) on a continuous-batching step's
shape, with each call's KV cache out of the L3 as in a real decode step.

    python benchmarks/decode_attention_rows.py [--rows 16] [--lens 16:512] [--threads 2]
        [--layout scattered|ordered] [--dtype f32|bf16|f16] [--calls 400] [--warm]
        [--cpu-time] [--csrc THIS/csrc] [--against OTHER/csrc]

The rows attend over context lengths spaced evenly over ``--lens`` (default 16..512,
the default model's 8 query heads on 2 KV heads, head_dim 64, block_size 16). The
calls rotate over enough separate caches (each its own blocks, tables and lengths)
that the caches read since a cache's last call outgrow the L3. ``scattered`` hands
each row blocks in random order; ``ordered`` hands them out in turn, as the block
manager does for prompts prefilled together. ``--rows 1 --lens 2048:2048`` is a
single decode row. With ``--against`` a library built from that csrc/ (an older
commit's) and this checkout's take turns call by call on the same caches, and
their outputs are compared. ``--warm`` calls one cache over and over (L2/L3
resident: the kernel's compute); ``--cpu-time`` times the calling thread's CPU
time, which with ``--threads 1`` leaves out the time other processes take the core
(a shared machine's medians otherwise measure its load). Prints per library: median
and fastest microseconds per call, and the GB/s of the cache bytes read at the median.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from atbcore.backends.cpu_kernels import build  # noqa: E402

SOURCES = ("attn.c", "attn_passes.c", "pool.c")
ARGS = struct.Struct("<32qd2q")  # DecAttnArgs without the int8 scale fields (attn.h)
DTYPES = {"f32": (torch.float32, 0), "bf16": (torch.bfloat16, 1), "f16": (torch.float16, 2)}
H, KV, D, BLOCK = 8, 2, 64, 16


def compile_lib(out: Path, csrc: Path) -> ctypes.CDLL:
    """The decode attention's sources in ``csrc`` as a library, with the project's flags."""
    lib = out / "libattn.so"
    cmd = ["cc", *build.BASE_FLAGS, *build.isa_flags()[0][1], "-I", str(csrc),
           *[str(csrc / s) for s in SOURCES], "-o", str(lib), "-lm", "-lpthread", "-ldl"]
    subprocess.run(cmd, check=True)
    dll = ctypes.CDLL(str(lib))
    fn = dll.atb_decode_attention
    fn.argtypes, fn.restype = [ctypes.c_char_p], ctypes.c_int64
    fn.pool_stats = dll.atb_pool_stats
    return fn


def backoff_jobs(fn) -> int:
    """Jobs the library's pool ran on the caller alone after a late worker (pool.c)."""
    out = (ctypes.c_int64 * 8)()
    fn.pool_stats(out)
    return out[1]


def make_cache(lens: list[int], layout: str, dtype: torch.dtype, gen: torch.Generator) -> dict:
    """One layer's paged K/V caches holding rows of ``lens`` keys, q, y and tables."""
    per_row = [(n + BLOCK - 1) // BLOCK for n in lens]
    total, width = sum(per_row), max(per_row)
    ids = torch.randperm(total, generator=gen) if layout == "scattered" else torch.arange(total)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    at = 0
    for b, nb in enumerate(per_row):
        table[b, :nb] = ids[at:at + nb]
        at += nb
    k = torch.randn(total, BLOCK, KV, D, generator=gen).to(dtype)
    v = torch.randn(total, BLOCK, KV, D, generator=gen).to(dtype)
    q = torch.randn(len(lens), H, D, generator=gen).to(dtype)
    return {"k": k, "v": v, "q": q, "y": torch.empty_like(q), "table": table,
            "lens": torch.tensor(lens, dtype=torch.int32), "n": width * BLOCK}


def pack(c: dict, y: torch.Tensor, code: int, threads: int) -> bytes:
    q, k, v, t = c["q"], c["k"], c["v"], c["table"]
    return ARGS.pack(q.data_ptr(), k.data_ptr(), v.data_ptr(), y.data_ptr(), 0, code, code, code,
                     q.shape[0], H, KV, D, q.stride(0), q.stride(1),
                     k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                     y.stride(0), y.stride(1), 0, 0, c["lens"].data_ptr(), 1, 0,
                     t.data_ptr(), 1, t.stride(0), BLOCK, threads, D ** -0.5, 0, c["n"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--lens", default="16:512", help="first:last context length")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layout", choices=("scattered", "ordered"), default="scattered")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="f32")
    ap.add_argument("--calls", type=int, default=400, help="timed calls per library")
    ap.add_argument("--cpu-time", action="store_true",
                    help="the calling thread's CPU time (with --threads 1: robust to a busy machine)")
    ap.add_argument("--warm", action="store_true", help="one cache, in the L2/L3 after its first call")
    ap.add_argument("--csrc", type=Path, default=build.CSRC, help="the sources measured as 'this'")
    ap.add_argument("--against", type=Path, default=None, help="another csrc/ to take turns with")
    args = ap.parse_args()
    first, last = (int(x) for x in args.lens.split(":"))
    lens = torch.linspace(first, last, args.rows).round().long().tolist()
    dtype, code = DTYPES[args.dtype]
    esize = torch.tensor([], dtype=dtype).element_size()
    nbytes = sum(lens) * KV * D * 2 * esize
    ncaches = 1 if args.warm else max(2, -(-64 * 2 ** 20 // nbytes))  # 64 MiB between calls
    gen = torch.Generator().manual_seed(0)
    caches = [make_cache(lens, args.layout, dtype, gen) for _ in range(ncaches)]
    with tempfile.TemporaryDirectory() as d:
        libs = [("this", compile_lib(Path(d), args.csrc))]
        if args.against is not None:
            (Path(d) / "other").mkdir()
            libs.append(("other", compile_lib(Path(d) / "other", args.against)))
        ys = {name: [torch.empty_like(c["q"]) for c in caches] for name, _ in libs}
        packed = {name: [pack(c, y, code, args.threads) for c, y in zip(caches, ys[name])]
                  for name, _ in libs}
        times: dict[str, list[float]] = {name: [] for name, _ in libs}
        clock = time.thread_time_ns if args.cpu_time else time.perf_counter_ns
        for i in range(args.calls + 2 * ncaches):   # the first rounds warm up
            for name, fn in (libs if i % 2 == 0 else libs[::-1]):
                a = packed[name][i % ncaches]
                t0 = clock()
                rc = fn(a)
                t1 = clock()
                if rc != 0:
                    raise RuntimeError(f"{name}: atb_decode_attention returned {rc}")
                if i >= 2 * ncaches:
                    times[name].append((t1 - t0) / 1e3)
    print(f"# {args.rows} rows, keys {first}..{last} (sum {sum(lens)}), {args.layout} blocks, "
          f"{args.dtype}, {args.threads} threads, {nbytes / 1e6:.2f} MB of cache per call, "
          f"{ncaches} caches in turn")
    for (name, t), (_, fn) in zip(times.items(), libs):
        med = statistics.median(t)
        print(f"{name:6s} median {med:8.1f} us  fastest {min(t):8.1f} us  "
              f"{nbytes / med / 1e3:6.1f} GB/s  ({backoff_jobs(fn)} calls on one thread: "
              "its pool backed off from a late worker)")
    if len(libs) == 2:
        diff = max((a - b).abs().max().item() for a, b in zip(ys["this"], ys["other"]))
        print(f"max |this - other| over the outputs: {diff:.3g}")


if __name__ == "__main__":
    main()
