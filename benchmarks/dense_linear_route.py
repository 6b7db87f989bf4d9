"""Where a dense fp32 / bf16 Linear of many rows should run on the CPU: oneDNN's GEMM
(torch's OpenMP team) or atb's C matmul (its own pool, panel-packed weights), at an
encoder's and a decoder prefill's shapes, interleaved in one process, optionally with
busy loops on the cores (the loaded case: cores shared with other processes).

    python benchmarks/dense_linear_route.py [--busy N] [--repeats 15] [--dtype fp32]

Prints per shape the median ms of each route (and, for fp32 GELU / bf16 up
projections, the LinearActivation alternatives: oneDNN with the GELU post-op vs the C
matmul then the C activation), the C matmul's speedup over oneDNN, and ``uptime``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..")]

from atbcore.backends.cpu_kernels import torch_ops as ck  # noqa: E402
from atbcore.backends.torch.linear_cpu import CpuLinear  # noqa: E402
from atbcore.backends.torch.linear_dnnl import dnnl_linear_activation  # noqa: E402
from atbcore.ops.registry import get_op  # noqa: E402

# (label, rows, in, out, gelu): MiniLM (hidden 384, inter 1536, QKV fused 1152) at a
# 32-sentence batch of 16 tokens (512 rows); the default decoder (hidden 512, inter
# 1376, QKV fused 1536, gate+up fused 2752) at 128 and 512 prompt tokens
SHAPES = [("enc qkv", 512, 384, 1152, False), ("enc o", 512, 384, 384, False),
          ("enc up+gelu", 512, 384, 1536, True), ("enc down", 512, 1536, 384, False),
          ("dec128 qkv", 128, 512, 1536, False), ("dec128 gate_up", 128, 512, 2752, False),
          ("dec128 down", 128, 1376, 512, False),
          ("dec512 qkv", 512, 512, 1536, False), ("dec512 gate_up", 512, 512, 2752, False),
          ("dec512 down", 512, 1376, 512, False)]


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", type=int, default=0, help="busy-loop processes to run beside")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    args = ap.parse_args()
    dt = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    stop = mp.Event()
    spinners = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    for s in spinners:
        s.start()
    try:
        print("uptime:", os.popen("uptime").read().strip(), "busy:", args.busy, flush=True)
        for label, rows, k, n, gelu in SHAPES:
            print(label, rows, k, n, run_shape(rows, k, n, gelu, dt, args.repeats), flush=True)
    finally:
        stop.set()
        for s in spinners:
            s.join()
    return 0


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``x @ w.T + b`` as one oneDNN GEMM (what atb ran many-row fp32 Linears on before
    the C matmul took every row count)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def run_shape(rows: int, k: int, n: int, gelu: bool, dt: torch.dtype, repeats: int
              ) -> dict[str, float]:
    g = torch.Generator().manual_seed(rows + k + n)
    x = torch.randn(rows, k, generator=g).to(dt)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dt)
    b = torch.randn(n, generator=g).to(dt)
    lin = get_op("Linear").Params(bias=True)
    act = get_op("LinearActivation").Params(bias=True, activation_type="gelu")
    c = CpuLinear(lin, w, b, None)
    out = torch.empty(rows, n, dtype=dt)
    routes = {"c_matmul": (lambda: c.run(x, out)) if not gelu else
              (lambda: ck.activation(c.run(x, out), "gelu"))}
    if gelu:
        routes["onednn"] = lambda: dnnl_linear_activation(act, x, w, b)
    elif dt == torch.float32:
        routes["onednn"] = lambda: onednn_linear(x, w, b)
    else:  # bf16 without a bf16 inner product: the widened fp32 GEMM
        routes["onednn_widened"] = lambda: onednn_linear(x.float(), w.float(), b.float())
    routes["f_linear"] = lambda: torch.nn.functional.linear(x, w, b)
    ms: dict[str, list[float]] = {r: [] for r in routes}
    with torch.inference_mode():
        for f in routes.values():
            f()
        for _ in range(repeats):
            for r, f in routes.items():
                t = time.perf_counter()
                for _ in range(5):
                    f()
                ms[r].append((time.perf_counter() - t) / 5 * 1e3)
    med = {r: round(statistics.median(v), 3) for r, v in ms.items()}
    base = med.get("onednn", med.get("onednn_widened"))
    med["c_speedup_vs_onednn"] = round(base / med["c_matmul"], 2)
    return med


if __name__ == "__main__":
    sys.exit(main())
