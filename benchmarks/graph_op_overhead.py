"""The seed's MLP GraphOp per call against the same layers in the plain framework.

The seed article's MLP block (LayerNorm, Linear hidden->inter, SiLU, Linear
inter->hidden, ResidualAdd; hidden 512, inter 1376) as an ``atb.GraphOp`` against the
same weights run with the framework's own ops, at 1 row (decode) and 128 rows
(prefill). Each framework runs in a process of its own with nothing else imported
(torch, Paddle and MindSpore each bring an OpenMP or thread-pool runtime, and Paddle
sets ``OMP_NUM_THREADS=1`` on import), once per setting of its process-wide knobs
(``SETTINGS``: kernel or BLAS threads, oneDNN, MindSpore's synchronous launch); per row count
the run whose plain side was fastest is reported, so the baseline is the framework at
its best on this machine. In that process the two sides take turns, each sample times
a loop of calls, and the median of the per-sample ratios is reported (with the
quartiles). The plain side is the fastest of the framework's usual ways to write the
block (``PLAIN``), weights laid out once the way its ops take them. ``atb_first_us``
times the GraphOp before the process has run a single plain op: far below ``atb_us``
means the framework's threads slow atb down in the same process. torch always; Paddle
and MindSpore (PyNative) when installed; NumPy arrays on the ``numpy_c`` backend (atb's
C kernels, no framework) against the layers written in NumPy. Also: launches per call
and the plan's arena bytes (from the pool).

    python benchmarks/graph_op_overhead.py [--samples 30] [--frameworks torch,paddle,mindspore]
        [--out bench-results/graph_op_overhead.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..")]

import numpy as np  # noqa: E402

HIDDEN, INTER = 512, 1376
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
# the process-wide settings each framework is run under, one process each
SETTINGS: dict[str, list[dict[str, Any]]] = {
    "torch": [{"threads": CPUS}],
    "numpy": [{"blas_threads": 1}, {"blas_threads": CPUS}],  # NumPy's OpenBLAS, read at load
    "paddle": [{"threads": 1}, {"threads": CPUS}, {"threads": CPUS, "onednn": True}],
    "mindspore": [{"threads": CPUS, "blocking": False}, {"threads": CPUS, "blocking": True},
                  {"threads": 1, "blocking": True}],
}
Plain = Callable[[Any], Any]


def _ratio(atb_call: Callable[[], Any], plain_call: Callable[[], Any], samples: int,
           budget_s: float = 0.02, sync: Callable[[Any], Any] | None = None
           ) -> dict[str, float]:
    """Median (and quartiles) of atb time / plain time over interleaved samples.
    ``sync(result)`` (a framework that runs ops asynchronously) ends each timed loop
    by waiting for its last result, so the work a loop queued is charged to it and
    not to the next one."""
    sync = sync or (lambda r: None)
    for _ in range(20):
        atb_call()
        sync(plain_call())
    n = _loop_length(plain_call, budget_s, sync)
    ratios, ta, tb = [], [], []
    for _ in range(samples):
        a = _time_loop(atb_call, n, sync)
        b = _time_loop(plain_call, n, sync)
        ratios.append(a / b)
        ta.append(a / n * 1e6)
        tb.append(b / n * 1e6)
    q = statistics.quantiles(ratios, n=4)
    return {"ratio": statistics.median(ratios), "q1": q[0], "q3": q[2],
            "atb_us": statistics.median(ta), "plain_us": statistics.median(tb)}


def _time_loop(call: Callable[[], Any], n: int, sync: Callable[[Any], Any]) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        r = call()
    sync(r)
    return time.perf_counter() - t0


def _loop_length(call: Callable[[], Any], budget_s: float, sync: Callable[[Any], Any]) -> int:
    t = _time_loop(call, 1, sync)
    return max(3, min(5000, int(budget_s / max(t, 1e-7))))


def _alone_us(call: Callable[[], Any], sync: Callable[[Any], Any] | None = None) -> float:
    """Median microseconds per call of ``call`` timed on its own (after a warm-up)."""
    sync = sync or (lambda r: None)
    for _ in range(20):
        sync(call())
    n = _loop_length(call, 0.02, sync)
    return statistics.median(_time_loop(call, n, sync) / n * 1e6 for _ in range(9))


def _fastest(candidates: dict[str, Plain], x: Any, sync: Callable[[Any], Any] | None = None
             ) -> tuple[str, Plain]:
    """The fastest way (by name) of writing the plain block, timed on ``x``."""
    return min(candidates.items(), key=lambda kv: _alone_us(lambda: kv[1](x), sync))


def _kernels_alone(core: Any, last: Any) -> Callable[[], Any] | None:
    """The C calls of ``core``'s last program made again with no Python around them
    (its recorded native run on the last call's tensors), when that program is one
    native run; None otherwise. Its time against ``atb_us`` splits a call into
    kernels and the Python before and around them. ``last`` is that call's result,
    kept alive here: a native run's record holds no reference to a run's fresh outputs
    (their addresses are patched before each run), so the table writes where ``last``
    lives only while something else holds it."""
    hot = getattr(core, "_hot", None)
    prog = hot[1].programs.get(hot[2]) if hot is not None else None
    ops = prog.native.ops if prog is not None and prog.native is not None else None
    if not ops or len(ops) != 1 or type(ops[0]) is int:
        return None
    seg, run = ops[0], prog.native

    def kernels() -> None:
        assert last is not None  # held by this closure while the table writes into it
        seg.table[0], seg.table[1] = 0, len(seg.pairs)
        run._run_steps(seg.table)
    return kernels


def _measure(fw: str, mlp: Callable[[Any], Any], plain: dict[str, Plain],
             inputs: dict[int, Any], samples: int, to_numpy: Callable[[Any], Any],
             sync: Callable[[Any], Any] | None = None,
             plan: Callable[[], Any] | None = None,
             core: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Both sides at each row count; the GraphOp is first timed before any plain op runs
    (and, where its program is one native run, its kernels alone: ``kernels_us``)."""
    first = {rows: _alone_us(lambda x=x: mlp(x), sync) for rows, x in inputs.items()}
    out: dict[str, Any] = {}
    for rows, x in inputs.items():
        name, fn = _fastest(plain, x, sync)
        d = _check(to_numpy(mlp(x)), to_numpy(fn(x)), f"{fw} rows {rows}")
        r = _ratio(lambda: mlp(x), lambda: fn(x), samples, sync=sync)
        out[f"rows_{rows}"] = {**r, "max_abs_diff": d, "plain": name,
                               "atb_first_us": first[rows]}
        kernels = _kernels_alone(core(), mlp(x)) if core is not None else None
        if kernels is not None:
            out[f"rows_{rows}"]["kernels_us"] = _alone_us(kernels)
        if plan is not None:
            out[f"rows_{rows}"].update(launches=plan().launches,
                                       arena_bytes=plan().memory.arena_bytes)
    return out


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"ln_w": 1 + 0.1 * rng.standard_normal(HIDDEN, dtype=np.float32),
            "ln_b": 0.1 * rng.standard_normal(HIDDEN, dtype=np.float32),
            "w1": rng.standard_normal((INTER, HIDDEN), dtype=np.float32) * HIDDEN ** -0.5,
            "b1": 0.1 * rng.standard_normal(INTER, dtype=np.float32),
            "w2": rng.standard_normal((HIDDEN, INTER), dtype=np.float32) * INTER ** -0.5,
            "b2": 0.1 * rng.standard_normal(HIDDEN, dtype=np.float32)}


def _inputs(rows: int) -> np.ndarray:
    return np.random.default_rng(rows).standard_normal((1, rows, HIDDEN), dtype=np.float32)


_NAMES = {"layer_norm.weight": "ln_w", "layer_norm.bias": "ln_b", "linear.weight": "w1",
          "linear.bias": "b1", "linear_1.weight": "w2", "linear_1.bias": "b2"}
# Paddle and MindSpore name the GraphOp's layers by position: 0 LayerNorm, 1 and 3 Linear
_BY_POSITION = {"0.weight": "ln_w", "0.bias": "ln_b", "1.weight": "w1", "1.bias": "b1",
                "3.weight": "w2", "3.bias": "b2"}


def _key(name: str) -> str:
    """The weight a GraphOp parameter (named ``...layer_norm.weight`` etc.) takes."""
    return next(v for k, v in _NAMES.items() if name.endswith("." + k) or name == k)


def _check(a: Any, b: Any, what: str) -> float:
    d = float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))
    if d > 1e-3:
        raise SystemExit(f"{what}: atb and the plain layers disagree (max |diff| {d})")
    return d


def _seed_mlp(atb: Any, **kw: Any) -> Any:
    return atb.GraphOp([atb.LayerNorm(eps=1e-5), atb.Linear(out_features=INTER), atb.SiLU(),
                        atb.Linear(out_features=HIDDEN), atb.ResidualAdd()], **kw)


def bench_torch(samples: int, settings: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import atb_torch as atb

    torch.set_num_threads(settings["threads"])
    w = {k: torch.from_numpy(v) for k, v in _weights().items()}
    mlp = _seed_mlp(atb)
    with torch.no_grad():
        mlp(torch.zeros(1, 1, HIDDEN))
        for name, p in mlp.named_parameters():
            p.copy_(w[_key(name)])

        def functional(x: torch.Tensor) -> torch.Tensor:
            h = F.layer_norm(x, (HIDDEN,), w["ln_w"], w["ln_b"], 1e-5)
            return F.linear(F.silu(F.linear(h, w["w1"], w["b1"])), w["w2"], w["b2"]) + x

        inputs = {rows: torch.from_numpy(_inputs(rows)) for rows in (1, 128)}
        return _measure("torch", mlp, {"functional": functional}, inputs, samples,
                        lambda t: t.numpy(), plan=lambda: mlp.core.last_plan,
                        core=lambda: mlp.core)


def bench_paddle(samples: int, settings: dict[str, Any]) -> dict[str, Any]:
    import paddle
    import paddle.nn.functional as F

    import atb_paddle as atb

    paddle.base.core.set_num_threads(settings["threads"])  # its math library's threads
    paddle.set_flags({"FLAGS_use_mkldnn": bool(settings.get("onednn"))})
    w = {k: paddle.to_tensor(v) for k, v in _weights().items()}
    mlp = _seed_mlp(atb)
    with paddle.no_grad():
        mlp(paddle.zeros([1, 1, HIDDEN]))
        for name, p in mlp.named_parameters():
            v = w[_BY_POSITION[name]]
            p.set_value(v if tuple(p.shape) == tuple(v.shape) else v.T)
        # paddle's linear takes weight [in, out]: lay it out once, not per call
        w1, w2 = (paddle.to_tensor(np.ascontiguousarray(_weights()[k].T)) for k in ("w1", "w2"))

        def functional(x: Any) -> Any:
            h = F.layer_norm(x, [HIDDEN], w["ln_w"], w["ln_b"], 1e-5)
            return F.linear(F.silu(F.linear(h, w1, w["b1"])), w2, w["b2"]) + x

        inputs = {rows: paddle.to_tensor(_inputs(rows)) for rows in (1, 128)}
        return _measure("paddle", mlp, {"functional": functional}, inputs, samples,
                        lambda t: t.numpy())


def bench_mindspore(samples: int, settings: dict[str, Any]) -> dict[str, Any]:
    import mindspore as ms
    from mindspore import ops

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    ms.device_context.cpu.op_tuning.threads_num(settings["threads"])  # default 25
    if settings["blocking"]:
        ms.runtime.launch_blocking()  # each op runs on the calling thread, no queue
    import atb_mindspore as atb

    w = {k: ms.Tensor(v) for k, v in _weights().items()}
    mlp = _seed_mlp(atb)
    mlp(ms.Tensor(np.zeros((1, 1, HIDDEN), np.float32)))
    for p in mlp.get_parameters():
        v = w[_BY_POSITION[".".join(p.name.split(".")[-2:])]]
        p.set_data(v if tuple(p.shape) == tuple(v.shape) else v.T)

    ln = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=1e-5)
    w1, w2 = (ms.Tensor(np.ascontiguousarray(_weights()[k].T)) for k in ("w1", "w2"))

    def dense(x: Any) -> Any:  # the CPU kernels MindSpore registers (no LayerNormExt there)
        h = ln(x, w["ln_w"], w["ln_b"])[0]
        return ops.dense(ops.silu(ops.dense(h, w["w1"], w["b1"])), w["w2"], w["b2"]) + x

    def matmul(x: Any) -> Any:  # weights laid out [in, out] once
        h = ln(x, w["ln_w"], w["ln_b"])[0]
        return ops.matmul(ops.silu(ops.matmul(h, w1) + w["b1"]), w2) + w["b2"] + x

    inputs = {rows: ms.Tensor(_inputs(rows)) for rows in (1, 128)}
    return _measure("mindspore", mlp, {"ops.dense": dense, "ops.matmul": matmul}, inputs,
                    samples, lambda t: t.asnumpy(), sync=lambda r: r.asnumpy())


def bench_numpy(samples: int, settings: dict[str, Any]) -> dict[str, Any]:
    """NumPy arrays: the GraphOp on the ``numpy_c`` backend (atb's C kernels on the
    arrays, no framework) against the same layers written in NumPy, same weights."""
    import atbcore as atb
    from atbcore.ops.ffn import ffn_input_names

    mlp = _seed_mlp(atb, backend="numpy_c")
    mlp(np.zeros((1, 1, HIDDEN), np.float32))
    wm, w = dict(mlp.graph.weights), {}
    for n in mlp.graph.nodes:  # the fused graph: LayerNorm, FusedFeedForward
        names = ("x", "weight", "bias") if n.op == "LayerNorm" else ffn_input_names(n.params)
        for name, t in zip(names, n.inputs):
            if t in wm:  # the layout pass may hold a packed form: read it as logical
                w[f"{n.op}.{name}"] = np.asarray(wm[t])
    ln_w, ln_b = w["LayerNorm.weight"], w["LayerNorm.bias"]
    w1t = np.ascontiguousarray(w["FusedFeedForward.up_w"].T)      # [H, I]
    w2t = np.ascontiguousarray(w["FusedFeedForward.down_w"].T)    # [I, H]
    b1, b2 = w["FusedFeedForward.up_b"], w["FusedFeedForward.down_b"]

    def layers(x: np.ndarray) -> np.ndarray:
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        h = (x - mu) / np.sqrt(var + 1e-5) * ln_w + ln_b
        u = h @ w1t + b1
        return (u / (1 + np.exp(-u))) @ w2t + b2 + x

    inputs = {rows: _inputs(rows) for rows in (1, 128)}
    return _measure("numpy", mlp, {"numpy": layers}, inputs, samples, lambda a: a,
                    plan=lambda: mlp.last_plan, core=lambda: mlp)


BENCHES = {"torch": bench_torch, "mindspore": bench_mindspore, "paddle": bench_paddle,
           "numpy": bench_numpy}


def _run_child(fw: str, settings: dict[str, Any], samples: int) -> dict[str, Any] | str:
    """One framework under one setting, in a fresh process: its result, or why not."""
    cmd = [sys.executable, os.path.abspath(__file__), "--samples", str(samples),
           "--child", json.dumps({"framework": fw, "settings": settings})]
    env = dict(os.environ)
    if "blas_threads" in settings:
        env["OPENBLAS_NUM_THREADS"] = str(settings["blas_threads"])
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"failed (exit {p.returncode}): {tail}"
    return json.loads(lines[-1])


def _best(fw: str, runs: list[tuple[dict[str, Any], dict[str, Any] | str]]) -> Any:
    """Per row count, the run whose plain side was fastest, with the settings it ran
    under; every run's plain and atb times under ``tried``."""
    ok = [(s, r) for s, r in runs if isinstance(r, dict)]
    if not ok:
        return runs[0][1]
    out: dict[str, Any] = {}
    for rows in ok[0][1]:
        s, r = min(ok, key=lambda sr: sr[1][rows]["plain_us"])
        out[rows] = {**r[rows], "settings": s}
    out["tried"] = [{"settings": s, **({k: {"plain_us": v["plain_us"], "atb_us": v["atb_us"],
                                            "plain": v["plain"]} for k, v in r.items()}
                                         if isinstance(r, dict) else {"error": r})}
                    for s, r in runs]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--frameworks", default="torch,mindspore,paddle,numpy")
    ap.add_argument("--out", default="")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)  # one run, JSON out
    a = ap.parse_args(argv)
    if a.child:
        job = json.loads(a.child)
        print(json.dumps(BENCHES[job["framework"]](a.samples, job["settings"])))
        return 0
    results: dict[str, Any] = {"hidden": HIDDEN, "inter": INTER, "cpus": CPUS}
    for fw in [f.strip() for f in a.frameworks.split(",") if f.strip()]:
        if fw not in BENCHES:
            ap.error(f"--frameworks: expected some of {sorted(BENCHES)}, got {fw!r}")
        if importlib.util.find_spec(fw) is None:
            results[fw] = "not installed"
            continue
        results[fw] = _best(fw, [(s, _run_child(fw, s, a.samples)) for s in SETTINGS[fw]])
    for fw, r in results.items():
        if not isinstance(r, dict):
            print(f"{fw}: {r}")
            continue
        for rows, v in r.items():
            if not rows.startswith("rows_"):
                continue
            print(f"{fw:10s} {rows:8s} GraphOp / plain = {v['ratio']:.3f} "
                  f"(q1 {v['q1']:.3f}, q3 {v['q3']:.3f}; {v['atb_us']:.1f} vs "
                  f"{v['plain_us']:.1f} us; GraphOp alone first {v['atb_first_us']:.1f} us; "
                  f"plain {v['plain']} {v['settings']})"
                  + (f", launches {v['launches']}, arena {v['arena_bytes']} B"
                     if "launches" in v else "")
                  + (f", kernels alone {v['kernels_us']:.1f} us" if "kernels_us" in v else ""))
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
