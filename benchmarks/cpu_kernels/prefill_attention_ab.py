"""The C prefill attention (csrc/flash.c) of this checkout against another csrc/, in one
process, taking turns: each is compiled into its own library (build.py's flags and this
CPU's best ISA) and called directly with the same packed q/k/v (8 query heads on 2 KV
heads, head_dim 64, causal).

    python benchmarks/cpu_kernels/prefill_attention_ab.py --against OTHER/csrc
        [--lens 16p | --lens N --count C] [--dtype fp32|bf16|fp16] [--threads 2]
        [--rounds 15] [--reps 3] [--cpu]

"16p" (the default) is the LLM's 16-prompt prefill: lengths linspace(16, 512, 16). Each
line: median and fastest ms per call and causal GF/s (sum n(n+1)/2 x H x D x 4 flops);
then whether the outputs are bit-equal. --cpu times the calling thread's CPU time
(one thread only: it leaves out time the shared machine's other processes take).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from atbcore.backends.cpu_kernels import build  # noqa: E402
from atbcore.backends.cpu_kernels.torch_ops import DTYPE_CODES  # noqa: E402
from atbcore.backends.cpu_kernels.torch_prefill import _FLASH, _sequences  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compile_lib(csrc: Path, out: Path) -> ctypes.CDLL:
    """csrc's sources into one shared library at out, loaded."""
    flags = [f for f in build.BASE_FLAGS if f != "-shared"] + list(build.isa_flags()[0][1])
    procs = [subprocess.Popen(["gcc", *flags, "-c", str(csrc / s), "-o", str(out.with_suffix(f".{i}.o"))])
             for i, s in enumerate(build.SOURCES) if (csrc / s).exists()]
    if any(p.wait() for p in procs):
        raise SystemExit(f"compiling {csrc} failed")
    subprocess.run(["gcc", "-shared", "-o", str(out), *map(str, out.parent.glob(f"{out.stem}.*.o")),
                    "-lm", "-ldl", "-lpthread"], check=True)
    fn = ctypes.CDLL(str(out)).atb_prefill_attention
    fn.argtypes, fn.restype = [ctypes.c_char_p], ctypes.c_int64
    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", type=Path, required=True, help="another csrc/ (an older commit's)")
    ap.add_argument("--lens", default="16p")
    ap.add_argument("--count", type=int, default=1)
    ap.add_argument("--dtype", choices=DTYPES, default="fp32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=3, help="calls per turn")
    ap.add_argument("--cpu", action="store_true", help="thread CPU time (use with --threads 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lens = ([round(16 + i * (512 - 16) / 15) for i in range(16)] if args.lens == "16p"
            else [int(args.lens)] * args.count)
    dt, t = DTYPES[args.dtype], sum(lens)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, h, 64, generator=g).to(dt) for h in (8, 2, 2))
    seqs = _sequences("prefill_attention", q, k, v, q, lens, None)
    flops = sum(n * (n + 1) / 2 for n in lens) * 8 * 64 * 4
    clock = time.thread_time if args.cpu else time.perf_counter
    with tempfile.TemporaryDirectory() as d:
        runs = []
        for name, csrc in (("this", ROOT / "atbcore/backends/cpu_kernels/csrc"), ("other", args.against)):
            fn, out = compile_lib(csrc, Path(d) / f"{name}.so"), torch.empty_like(q)
            packed = _FLASH.pack(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                 *[DTYPE_CODES[dt]] * 3, 8, 2, 64, *q.stride()[:2], *k.stride()[:2],
                                 *v.stride()[:2], *out.stride()[:2], len(seqs) // 6,
                                 ctypes.addressof(seqs), 1, 0, args.threads, 0.125)
            runs.append((name, fn, packed, out, []))
        for _ in range(args.rounds):
            for _, fn, packed, _, times in runs:
                for _ in range(args.reps):
                    t0 = clock()
                    if fn(packed):
                        raise SystemExit("atb_prefill_attention failed")
                    times.append(clock() - t0)
    print(f"# {args.lens} x{args.count if args.lens != '16p' else ''} tokens {t} {args.dtype} "
          f"threads {args.threads} isa {build.isa_flags()[0][0]} load {os.getloadavg()[0]:.1f}")
    for name, _, _, _, times in runs:
        s = sorted(times)
        med = s[len(s) // 2]
        print(f"{name:6s} median {med * 1e3:8.3f} ms {flops / med / 1e9:6.1f} GF/s   "
              f"fastest {s[0] * 1e3:8.3f} ms {flops / s[0] / 1e9:6.1f} GF/s")
    print(f"bit-equal: {torch.equal(runs[0][3], runs[1][3])}")


if __name__ == "__main__":
    main()
