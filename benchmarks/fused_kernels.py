"""The one-kernel C ops against the torch composites they replace (not a timed test).

For each fused op, at decode size (1 row, hidden 512 and 4096) and prefill size
(128 rows), fp32 and bf16: the torch kernel as registered (one C kernel on the
CPU, called through the kernel's ``fn``, so its Python overhead is included)
against the torch composite that ran before (the same code the kernels keep as
their fallback). Runs alternate A/B in one process; each sample times a loop of
calls; medians of the samples are reported, with the speed-up.

Then launches per forward of the issue-3 acceptance layer (a LLaMA layer from
primitives, ``tests/core/graph/llama_graphs.py``) fused at ``standard`` vs
unfused, counted by :class:`~atbcore.backends.cpu_kernels.counting.LaunchCounter`
with the C kernels on, and in a subprocess with them off (``ATB_CPU_KERNELS=0``,
what the torch composites dispatch).

    python benchmarks/fused_kernels.py [--repeats 15] [--quick] [--threads N] \
        [--clock wall|thread] [--out bench-results/fused_kernels.json]

On a machine shared with other jobs, ``--threads 1 --clock thread`` compares the
work each side does (torch's OpenMP threads stall for whole scheduler slices
when the cores are oversubscribed, which wall-clock medians then report).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests"),
                os.path.join(HERE, "..", "tests", "core", "graph")]

import torch  # noqa: E402

from atbcore.backends import get_backend  # noqa: E402
from atbcore.backends.cpu_kernels import build_info  # noqa: E402
from atbcore.backends.cpu_kernels.counting import LaunchCounter  # noqa: E402
from atbcore.backends.torch import TORCH_KERNELS  # noqa: E402
from atbcore.backends.torch import norm as tnorm, rope as trope, softmax as tsoftmax  # noqa: E402
from atbcore.ops.activation import get_activation  # noqa: E402
from atbcore.ops.registry import get_op  # noqa: E402

get_backend("torch").load()


CLOCK = time.perf_counter


def per_call_us(fn: Callable[[], object], budget_s: float = 0.02) -> Callable[[], float]:
    """A sampler: times a loop of ``fn`` sized to ~budget_s, returns us per call."""
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    n = max(3, min(20000, int(budget_s / one)))

    def sample() -> float:
        t = CLOCK()
        for _ in range(n):
            fn()
        return (CLOCK() - t) / n * 1e6

    return sample


def interleaved(a: Callable[[], object], b: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Medians (us per call) of alternating samples of a and b."""
    sa, sb = per_call_us(a), per_call_us(b)
    xs, ys = [], []
    for i in range(repeats):
        if i % 2:
            ys.append(sb())
            xs.append(sa())
        else:
            xs.append(sa())
            ys.append(sb())
    return statistics.median(xs), statistics.median(ys)


def _p(op: str, **kw):
    return get_op(op).make_params(kw)


def cases(rows: int, hidden: int, dt: torch.dtype) -> dict[str, tuple[Callable, Callable]]:
    """name -> (C kernel call, torch composite call) on the same inputs."""
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g).to(dt)

    inter = hidden * 11008 // 4096                         # LLaMA's MLP ratio
    heads, d = max(1, hidden // 128), 128
    x, res, w, b = r(rows, hidden), r(rows, hidden), r(hidden) + 1, r(hidden)
    gu, up, bias = r(rows, 2 * inter), r(rows, inter), r(inter)
    K = TORCH_KERNELS
    pr, pl = _p("RmsNorm"), _p("LayerNorm")
    out: dict[str, tuple[Callable, Callable]] = {
        "RmsNorm": (lambda: K["RmsNorm"].fn(pr, {"x": x, "weight": w}),
                    lambda: tnorm._rms_norm(pr, x, w)),
        "AddRmsNorm": (lambda: K["AddRmsNorm"].fn(pr, {"x": x, "residual": res, "weight": w}),
                       lambda: tnorm._rms_norm(pr, torch.add(x, res), w)),
        "LayerNorm": (lambda: K["LayerNorm"].fn(pl, {"x": x, "weight": w, "bias": b}),
                      lambda: tnorm._layer_norm(pl, x, w, b)),
        "AddLayerNorm": (lambda: K["AddLayerNorm"].fn(pl, {"x": x, "residual": res, "weight": w,
                                                          "bias": b}),
                         lambda: tnorm._layer_norm(pl, torch.add(x, res), w, b)),
    }
    swiglu, gelu = get_activation("swiglu"), get_activation("gelu")
    ps, pg = _p("SwiGLU"), _p("Gelu")
    out["SwiGLU"] = (lambda: K["SwiGLU"].fn(ps, {"x": gu, "up": None}),
                     lambda: swiglu.torch(gu.float()).to(dt))
    # bias+GELU (the BERT FFN's middle): C bias+act vs add + gelu (what FusedFeedForward did)
    from atbcore.backends.cpu_kernels import torch_ops as ck
    out["bias+GELU"] = (lambda: ck.activation(up, "gelu", bias=bias),
                        lambda: gelu.torch(up.float().add_(bias.float())).to(dt))
    out["Gelu"] = (lambda: K["Gelu"].fn(pg, {"x": up}), lambda: gelu.torch(up.float()).to(dt))
    sm, psm = r(rows, hidden), _p("Softmax")
    out["Softmax"] = (lambda: K["Softmax"].fn(psm, {"x": sm}),
                      lambda: tsoftmax.softmax_fp32(sm, (1,), False).to(dt))
    # RoPE of q and k ([1, rows, heads * 128], positions = arange): decode is one token
    prope = _p("RoPE", num_heads=heads, max_seq_len=4096)
    q, k = r(1, rows, heads * d), r(1, rows, heads * d)
    pos = torch.arange(rows)[None] + 7
    rins = {"q": q, "k": k, "position_ids": pos, "cos": None, "sin": None}
    geo = trope.geometry("RoPE", prope, rins)
    out["RoPE(q,k)"] = (lambda: K["RoPE"].fn(prope, rins),
                        lambda: trope.rope_composite(prope, geo, rins))
    # RoPE + KV-cache write into [1, 4096, heads, 128]
    kc, vc = r(1, 4096, heads, d), r(1, 4096, heads, d)
    v = r(1, rows, heads * d)
    cins = dict(rins, v=v, key_cache=kc, value_cache=vc)
    pcache = _p("RopeKVCache", num_heads=heads, max_seq_len=4096)
    bidx = torch.zeros(1, rows, dtype=torch.long)

    def cache_composite():
        qr, kr = trope.rope_composite(prope, geo, rins)
        kc[bidx, pos] = kr.unflatten(-1, (heads, d))
        vc[bidx, pos] = v.unflatten(-1, (heads, d))
        return qr

    out["RopeKVCache"] = (lambda: K["RopeKVCache"].fn(pcache, cins), cache_composite)
    return out


def launches_of_the_acceptance_layer() -> dict[str, int]:
    """Counted launches per forward of the primitive LLaMA layer, fused and unfused."""
    from atbcore.graph.graph_op import GraphOp
    from llama_graphs import build_llama_layer_primitive
    from oracle import rand

    g = build_llama_layer_primitive()
    x = torch.from_numpy(rand([2, 8, 64], seed=2))
    res = {}
    for name, cfg in (("fused", None), ("unfused", {"fusion_level": "conservative"})):
        op = GraphOp(g, name=name, **({"fusion_config": cfg} if cfg else {}))
        op(x)
        with LaunchCounter() as c:
            op(x)
        res[name] = c.launches
        res[f"{name}_declared"] = op.last_launches
    return res


def launches_without_c() -> dict[str, int]:
    code = ("import json, sys; sys.argv = ['x']; sys.path.insert(0, %r); import fused_kernels as f; "
            "print(json.dumps(f.launches_of_the_acceptance_layer()))" % HERE)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, ATB_CPU_KERNELS="0"), timeout=600)
    if r.returncode:
        return {"error": r.stderr[-500:]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="fp32 only, hidden 4096 only")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads for the composites (default: torch's; the C kernels use one)")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: this thread's CPU time (fair on a shared machine; only "
                    "meaningful with --threads 1, as the C kernels are single-threaded)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    global CLOCK
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.clock == "thread":
        CLOCK = time.thread_time
    info = build_info()
    print(f"C kernels: {info.isa or 'unavailable'} {info.path or info.reason}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.clock} clock")
    rows_out = []
    dtypes = [torch.float32] if a.quick else [torch.float32, torch.bfloat16]
    hiddens = [4096] if a.quick else [512, 4096]
    print(f"{'op':<13}{'dtype':<6}{'rows':>5}{'hidden':>7}{'C us':>10}{'torch us':>10}{'x':>7}")
    for dt in dtypes:
        for rows in (1, 128):
            for hidden in hiddens:
                for name, (c_fn, t_fn) in cases(rows, hidden, dt).items():
                    tc, tt = interleaved(c_fn, t_fn, a.repeats)
                    row = {"op": name, "dtype": str(dt)[6:], "rows": rows, "hidden": hidden,
                           "c_us": round(tc, 2), "torch_us": round(tt, 2),
                           "speedup": round(tt / tc, 2)}
                    rows_out.append(row)
                    print(f"{name:<13}{row['dtype']:<6}{rows:>5}{hidden:>7}{tc:>10.1f}{tt:>10.1f}"
                          f"{tt / tc:>7.2f}", flush=True)
    lc = launches_of_the_acceptance_layer()
    lt = launches_without_c()
    print(f"LLaMA layer launches per forward, C kernels: fused {lc['fused']} / unfused "
          f"{lc['unfused']} (-{100 * (1 - lc['fused'] / lc['unfused']):.1f} %); torch "
          f"composites only: fused {lt.get('fused')} / unfused {lt.get('unfused')}")
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"build": {"isa": info.isa, "path": str(info.path)}, "clock": a.clock,
                       "torch_threads": torch.get_num_threads(), "kernels": rows_out,
                       "launches": {"with_c": lc, "torch_only": lt}}, f, indent=1)


if __name__ == "__main__":
    main()
