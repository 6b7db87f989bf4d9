"""The seed's MLP GraphOp per call against the same layers in the plain framework.

The seed article's MLP block (LayerNorm, Linear hidden->inter, SiLU, Linear
inter->hidden, ResidualAdd; hidden 512, inter 1376) as an ``atb.GraphOp`` against the
same weights run with the framework's own layers, at 1 row (decode) and 128 rows
(prefill), in one process: the two take turns, each sample times a loop of calls,
and the median of the per-sample ratios is reported (with the quartiles). torch
always; Paddle and MindSpore (PyNative) when installed, MindSpore imported first
(see the README); NumPy arrays on the ``numpy_c`` backend (atb's C kernels, no
framework) against the layers written in NumPy. Also: launches per call and the plan's arena bytes (from the pool).

    python benchmarks/graph_op_overhead.py [--samples 30] [--frameworks torch,paddle,mindspore]
        [--out bench-results/graph_op_overhead.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..")]

import numpy as np  # noqa: E402

HIDDEN, INTER = 512, 1376


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
    t0 = time.perf_counter()
    sync(plain_call())
    n = max(3, min(5000, int(budget_s / max(time.perf_counter() - t0, 1e-7))))
    ratios, ta, tb = [], [], []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(n):
            r = atb_call()
        sync(r)
        a = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(n):
            r = plain_call()
        sync(r)
        b = time.perf_counter() - t0
        ratios.append(a / b)
        ta.append(a / n * 1e6)
        tb.append(b / n * 1e6)
    q = statistics.quantiles(ratios, n=4)
    return {"ratio": statistics.median(ratios), "q1": q[0], "q3": q[2],
            "atb_us": statistics.median(ta), "plain_us": statistics.median(tb)}


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"ln_w": 1 + 0.1 * rng.standard_normal(HIDDEN, dtype=np.float32),
            "ln_b": 0.1 * rng.standard_normal(HIDDEN, dtype=np.float32),
            "w1": rng.standard_normal((INTER, HIDDEN), dtype=np.float32) * HIDDEN ** -0.5,
            "b1": 0.1 * rng.standard_normal(INTER, dtype=np.float32),
            "w2": rng.standard_normal((HIDDEN, INTER), dtype=np.float32) * INTER ** -0.5,
            "b2": 0.1 * rng.standard_normal(HIDDEN, dtype=np.float32)}


_NAMES = {"layer_norm.weight": "ln_w", "layer_norm.bias": "ln_b", "linear.weight": "w1",
          "linear.bias": "b1", "linear_1.weight": "w2", "linear_1.bias": "b2"}


def _key(name: str) -> str:
    """The weight a GraphOp parameter (named ``...layer_norm.weight`` etc.) takes."""
    return next(v for k, v in _NAMES.items() if name.endswith("." + k) or name == k)


def _check(a: Any, b: Any, what: str) -> float:
    d = float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))
    if d > 1e-3:
        raise SystemExit(f"{what}: atb and the plain layers disagree (max |diff| {d})")
    return d


def bench_torch(samples: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import atb_torch as atb

    w = {k: torch.from_numpy(v) for k, v in _weights().items()}
    mlp = atb.GraphOp([atb.LayerNorm(eps=1e-5), atb.Linear(out_features=INTER), atb.SiLU(),
                       atb.Linear(out_features=HIDDEN), atb.ResidualAdd()])
    out: dict[str, Any] = {}
    with torch.no_grad():
        mlp(torch.zeros(1, 1, HIDDEN))
        for name, p in mlp.named_parameters():
            p.copy_(w[_key(name)])

        def plain(x: torch.Tensor) -> torch.Tensor:
            h = F.layer_norm(x, (HIDDEN,), w["ln_w"], w["ln_b"], 1e-5)
            return F.linear(F.silu(F.linear(h, w["w1"], w["b1"])), w["w2"], w["b2"]) + x

        for rows in (1, 128):
            x = torch.randn(1, rows, HIDDEN, generator=torch.Generator().manual_seed(rows))
            d = _check(mlp(x), plain(x), f"torch rows {rows}")
            r = _ratio(lambda: mlp(x), lambda: plain(x), samples)
            plan = mlp.core.last_plan
            out[f"rows_{rows}"] = {**r, "max_abs_diff": d, "launches": plan.launches,
                                   "arena_bytes": plan.memory.arena_bytes}
    return out


def bench_paddle(samples: int) -> dict[str, Any]:
    import paddle
    import paddle.nn.functional as F

    import atb_paddle as atb

    w = {k: paddle.to_tensor(v) for k, v in _weights().items()}
    mlp = atb.GraphOp([atb.LayerNorm(eps=1e-5), atb.Linear(out_features=INTER), atb.SiLU(),
                       atb.Linear(out_features=HIDDEN), atb.ResidualAdd()])
    out: dict[str, Any] = {}
    with paddle.no_grad():
        mlp(paddle.zeros([1, 1, HIDDEN]))
        by_pos = {"0.weight": "ln_w", "0.bias": "ln_b", "1.weight": "w1", "1.bias": "b1",
                  "3.weight": "w2", "3.bias": "b2"}  # Paddle names the layers by position
        for name, p in mlp.named_parameters():
            v = w[by_pos[name]]
            p.set_value(v if tuple(p.shape) == tuple(v.shape) else v.T)

        def plain(x: Any) -> Any:
            h = F.layer_norm(x, [HIDDEN], w["ln_w"], w["ln_b"], 1e-5)
            return F.linear(F.silu(F.linear(h, w["w1"].T, w["b1"])), w["w2"].T, w["b2"]) + x

        for rows in (1, 128):
            x = paddle.to_tensor(np.random.default_rng(rows).standard_normal(
                (1, rows, HIDDEN), dtype=np.float32))
            d = _check(mlp(x).numpy(), plain(x).numpy(), f"paddle rows {rows}")
            out[f"rows_{rows}"] = {**_ratio(lambda: mlp(x), lambda: plain(x), samples),
                                   "max_abs_diff": d}
    return out


def bench_mindspore(samples: int) -> dict[str, Any]:
    import mindspore as ms
    from mindspore import ops

    import atb_mindspore as atb

    w = {k: ms.Tensor(v) for k, v in _weights().items()}
    mlp = atb.GraphOp([atb.LayerNorm(eps=1e-5), atb.Linear(out_features=INTER), atb.SiLU(),
                       atb.Linear(out_features=HIDDEN), atb.ResidualAdd()])
    out: dict[str, Any] = {}
    mlp(ms.Tensor(np.zeros((1, 1, HIDDEN), np.float32)))
    # MindSpore names the layers by position: 0 LayerNorm, 1 Linear, 3 Linear
    by_pos = {"0.weight": "ln_w", "0.bias": "ln_b", "1.weight": "w1", "1.bias": "b1",
              "3.weight": "w2", "3.bias": "b2"}
    for p in mlp.get_parameters():
        v = w[by_pos[".".join(p.name.split(".")[-2:])]]
        p.set_data(v if tuple(p.shape) == tuple(v.shape) else v.T)

    ln = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=1e-5)

    def plain(x: Any) -> Any:  # the CPU kernels MindSpore registers (no LayerNormExt there)
        h = ln(x, w["ln_w"], w["ln_b"])[0]
        return ops.dense(ops.silu(ops.dense(h, w["w1"], w["b1"])), w["w2"], w["b2"]) + x

    for rows in (1, 128):
        x = ms.Tensor(np.random.default_rng(rows).standard_normal((1, rows, HIDDEN),
                                                                  dtype=np.float32))
        d = _check(mlp(x).asnumpy(), plain(x).asnumpy(), f"mindspore rows {rows}")
        out[f"rows_{rows}"] = {**_ratio(lambda: mlp(x), lambda: plain(x), samples,
                                        sync=lambda r: r.asnumpy()), "max_abs_diff": d}
    return out


def bench_numpy(samples: int) -> dict[str, Any]:
    """NumPy arrays: the GraphOp on the ``numpy_c`` backend (atb's C kernels on the
    arrays, no framework) against the same layers written in NumPy, same weights."""
    import atbcore as atb
    from atbcore.ops.ffn import ffn_input_names

    mlp = atb.GraphOp([atb.LayerNorm(eps=1e-5), atb.Linear(out_features=INTER), atb.SiLU(),
                       atb.Linear(out_features=HIDDEN), atb.ResidualAdd()],
                      backend="numpy_c")
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

    def plain(x: np.ndarray) -> np.ndarray:
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        h = (x - mu) / np.sqrt(var + 1e-5) * ln_w + ln_b
        u = h @ w1t + b1
        return (u / (1 + np.exp(-u))) @ w2t + b2 + x

    out: dict[str, Any] = {}
    for rows in (1, 128):
        x = np.random.default_rng(rows).standard_normal((1, rows, HIDDEN), dtype=np.float32)
        d = _check(mlp(x), plain(x), f"numpy rows {rows}")
        r = _ratio(lambda: mlp(x), lambda: plain(x), samples)
        out[f"rows_{rows}"] = {**r, "max_abs_diff": d, "launches": mlp.last_plan.launches,
                               "arena_bytes": mlp.last_plan.memory.arena_bytes}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--frameworks", default="torch,mindspore,paddle,numpy")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    benches = {"torch": bench_torch, "mindspore": bench_mindspore, "paddle": bench_paddle,
               "numpy": bench_numpy}
    results: dict[str, Any] = {"hidden": HIDDEN, "inter": INTER}
    for fw in [f.strip() for f in a.frameworks.split(",") if f.strip()]:
        mod = {"torch": "torch", "mindspore": "mindspore", "paddle": "paddle",
               "numpy": "numpy"}[fw]
        if importlib.util.find_spec(mod) is None:
            results[fw] = "not installed"
            continue
        try:
            results[fw] = benches[fw](a.samples)
        except Exception as e:  # a framework's own failure is reported, not fatal
            results[fw] = f"failed: {type(e).__name__}: {e}"
    for fw, r in results.items():
        if not isinstance(r, dict):
            print(f"{fw}: {r}")
            continue
        for rows, v in r.items():
            print(f"{fw:10s} {rows:8s} GraphOp / plain = {v['ratio']:.3f} "
                  f"(q1 {v['q1']:.3f}, q3 {v['q3']:.3f}; {v['atb_us']:.1f} vs "
                  f"{v['plain_us']:.1f} us)" + (f", launches {v['launches']}, arena "
                                                f"{v['arena_bytes']} B" if "launches" in v
                                                else ""))
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
