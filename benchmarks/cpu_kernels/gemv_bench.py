"""Build and run the decode GEMV microbenchmark (gemv_bench.c) against this checkout's
kernel sources, with the flags the library is built with (build.py).

    python benchmarks/cpu_kernels/gemv_bench.py [--mode stream|l3|l2|rows]
        [--kinds read,fp32,bf16,w8,w8a8,w4] [--threads 1,2] [--reps 21]
        [--against OTHER/csrc --rounds 2]

Each line: mode, kernel, shape, threads, median microseconds per call, megabytes read
per call, GB/s. "stream" runs a decode step's weights (8 layers + head, more than the
L3) in order; "l3" repeats the seed MLP's two fp32-sized matmuls (5.6 MB, L3-resident);
"l2" is the fastest of many calls on one weight (GEMV_L2_N outputs, default 128, x 512;
GEMV_M rows, default 1): the kernel's own rate, robust to a shared machine. "rows" is the
gate|up matmul (L3-resident) at each row count of GEMV_MS (default 1,4,8,12,16,32,64,256):
median and fastest GF/s. GEMV_M also sets the rows of stream and l3 (GEMV_M=16 --mode
stream: a 16-row decode step's matmuls from DRAM). "read" is a
streaming read of the fp32 bytes of each shape on the same thread pool. --against builds
a second binary from another csrc/ (an older commit's) and the two take turns.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from atbcore.backends.cpu_kernels import build  # noqa: E402

HERE = Path(__file__).resolve().parent
SOURCES = ("linear.c", "panel.c", "panel_avx2.c", "pool.c", "linear_w4.c", "linear_w4_tile.c", "norm.c",
           "gemm_bf16.c", "gemm_i8.c", "panel_q8.c")


def compile_bench(out: Path, csrc: Path = build.CSRC) -> Path:
    """The benchmark binary, linked from the kernel sources in ``csrc`` (this checkout's
    by default) with the library's flags."""
    isa = build.isa_flags()[0][1]
    flags = [f for f in build.BASE_FLAGS if f not in ("-shared", "-fvisibility=hidden")]
    exe = out / "gemv_bench"
    cmd = (["cc", *flags, *isa, "-I", str(csrc), str(HERE / "gemv_bench.c")]
           + [str(csrc / s) for s in SOURCES if (csrc / s).exists()] + ["-o", str(exe), "-lm", "-lpthread", "-ldl"])
    subprocess.run(cmd, check=True)
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="stream", choices=("stream", "l3", "l2", "rows"))
    ap.add_argument("--kinds", default="read,fp32,bf16,w8,w8a8,w4")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--against", type=Path, default=None,
                    help="another csrc/ (e.g. an older commit's): both run, taking turns")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        exes = [("this", compile_bench(Path(d)))]
        if args.against is not None:
            (Path(d) / "other").mkdir()
            exes.append(("other", compile_bench(Path(d) / "other", args.against)))
        for r in range(args.rounds):
            for name, exe in exes:
                print(f"# {name} round {r}: load {os.getloadavg()[0]:.2f}  "
                      f"isa {build.isa_flags()[0][0]}", flush=True)
                subprocess.run([str(exe), args.mode, args.kinds, args.threads, str(args.reps)],
                               check=True)


if __name__ == "__main__":
    main()
