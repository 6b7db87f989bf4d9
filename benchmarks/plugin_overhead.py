"""What the plugin points cost a GraphOp that has no plugin.

Per call, interleaved in one process (each sample times a loop of calls of one
GraphOp, then of its twin; the median of the per-sample ratios is reported with
the quartiles):

* ``mlp_1row``: the seed's MLP block (LayerNorm, Linear 512->1376, SiLU, Linear,
  ResidualAdd) on one row of torch input;
* ``llama_decode``: a tiny Llama (hidden 64, 2 layers) lowered to a GraphOp
  (``lower_decoder``), one decode step with an ``atb.KVCache`` (when transformers
  is installed).

Each twin pair: ``manager`` -- the plugin manager loaded (the built-in plugins,
none implementing an execution hook) and asked per call, as shipped -- against
``bypassed`` -- the same block with the plugin check replaced by a constant
``False`` (no plugin system on the call path at all). ``ratio`` near 1.0 means the
points cost nothing without plugins. For scale, ``with_rope_plugin`` times the
decode step with a pass-through ``atb_rope`` plugin installed against ``bypassed``.

    python benchmarks/plugin_overhead.py [--samples 25] [--out bench-results/plugin_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..")]


def _ratio(a: Callable[[], Any], b: Callable[[], Any], samples: int,
           budget_s: float = 0.02) -> dict[str, float]:
    for _ in range(20):
        a()
        b()
    t0 = time.perf_counter()
    b()
    n = max(3, min(5000, int(budget_s / max(time.perf_counter() - t0, 1e-7))))
    ratios, ta, tb = [], [], []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(n):
            a()
        x = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(n):
            b()
        y = time.perf_counter() - t0
        ratios.append(x / y)
        ta.append(x / n * 1e6)
        tb.append(y / n * 1e6)
    q = statistics.quantiles(ratios, n=4)
    return {"ratio": statistics.median(ratios), "q1": q[0], "q3": q[2],
            "a_us": statistics.median(ta), "b_us": statistics.median(tb), "calls": n}


def _bypassed(op: Any) -> Any:
    op._plugins_active = lambda: False  # the instance's own: no plugin system asked
    return op


def _mlp(samples: int) -> dict:
    import torch

    from atbcore.graph import layers as L
    from atbcore.graph.graph_op import GraphOp

    def block() -> GraphOp:
        return GraphOp([L.LayerNorm("ln"), L.Linear("up", out_features=1376, seed=1), L.SiLU(),
                        L.Linear("down", out_features=512, seed=2), L.ResidualAdd()], name="mlp")

    x = torch.randn(1, 512)
    shipped, bare = block(), _bypassed(block())
    return _ratio(lambda: shipped(x), lambda: bare(x), samples)


def _llama(samples: int) -> dict:
    import torch
    import transformers as tf

    from atb_torch.models.lower import lower_decoder
    from atbcore.memory import KVCache
    from atbcore.plugin import get_plugin_manager, hookimpl

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, vocab_size=256)
    hf = tf.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(3, 256, (1, 4))
    tok = torch.tensor([[5]])

    def stepper(op: Any) -> Callable[[], Any]:
        cache = KVCache(2, 1, 2048, 2, 16, dtype="fp32")
        op(ids, kv_cache=cache)

        def step() -> Any:
            if cache.seq_lens(layer=0)[0] >= 2040:
                cache.reset()
                op(ids, kv_cache=cache)
            with torch.no_grad():
                return op(tok, kv_cache=cache)
        return step

    shipped, bare = stepper(lower_decoder(hf)), stepper(_bypassed(lower_decoder(hf)))
    out = {"llama_decode": _ratio(shipped, bare, samples)}

    class PassThrough:
        @hookimpl
        def atb_rope(self, payload: Any) -> None:
            return None

    get_plugin_manager().register(PassThrough(), name="bench_pass_through")
    plugged = stepper(lower_decoder(hf))
    out["with_rope_plugin"] = _ratio(plugged, bare, max(5, samples // 3))
    get_plugin_manager().unregister(name="bench_pass_through")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=25)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch

    from atbcore.plugin import get_plugin_manager

    torch.set_num_threads(1)
    get_plugin_manager()  # loaded as in any process that has used atb
    res = {"mlp_1row": _mlp(args.samples)}
    import importlib.util

    if importlib.util.find_spec("transformers"):
        res.update(_llama(args.samples))
    for name, r in res.items():
        print(f"{name:18s} ratio {r['ratio']:.3f} (q1 {r['q1']:.3f}, q3 {r['q3']:.3f})  "
              f"{r['a_us']:.1f} us vs {r['b_us']:.1f} us per call")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
