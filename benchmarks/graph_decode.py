"""A Hugging Face Llama lowered to one core GraphOp (``atb_torch.models.lower``) against
``atb.compile``'s decode plan on the same model: decode step time, one process.

The embedded default model's sizes (hidden 512, 8 layers, 8 heads, 2 KV heads, inter
1376, vocab 32000), fp32 (or ``--dtype bf16``), batch 1, a 32-token prompt; each sample times ``--steps``
decode steps of one engine, the two take turns, and the best and median per-step
times of ``--samples`` samples are reported with their ratio. Also: the graph's
launches per step and its arena bytes. ``--quantize w8|w8a8|w4`` quantizes both
engines' Linears (the same codes: the lowered graph's core quantized Linears against the
runner's).

    python benchmarks/graph_decode.py [--samples 15] [--steps 16] [--threads 2] [--dtype bf16]
                                      [--quantize w8|w8a8|w4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..")]

import torch  # noqa: E402

H, L, NH, KV, I, V = 512, 8, 8, 2, 1376, 32000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--quantize", choices=("w8", "w8a8", "w4"), default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    import atb_torch as atb
    from atb_torch.models.lower import lower_decoder
    from atbcore.memory import KVCache
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(hidden_size=H, num_hidden_layers=L, num_attention_heads=NH,
                                      num_key_value_heads=KV, intermediate_size=I,
                                      vocab_size=V)).eval()
    if a.dtype == "bf16":
        hf = hf.to(torch.bfloat16)
    ids = torch.randint(3, V, (1, 32), generator=torch.Generator().manual_seed(1))
    cap = 32 + (a.samples + 1) * a.steps + 8
    op = lower_decoder(hf, quantize=a.quantize)
    cache = KVCache(L, 1, cap, KV, H // NH, dtype=a.dtype)
    runner = atb.compile(hf, opt_level=2, quantize=a.quantize).atb_runner
    rcache = runner.new_cache(1, cap)
    tok, rtok = ids[:, -1:], ids[0, -1:]
    with torch.no_grad():
        op(ids, kv_cache=cache)
        runner.prefill(ids, rcache)
        engines = {"graph": lambda: op(tok, kv_cache=cache),
                   "compile": lambda: runner.decode(rtok, rcache)}
        for f in engines.values():
            f()
        times: dict[str, list[float]] = {k: [] for k in engines}
        for _ in range(a.samples):
            for name, f in engines.items():
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    f()
                times[name].append((time.perf_counter() - t0) / a.steps * 1e3)
    plan = op._in_place.last_plan
    for name, ts in times.items():
        print(f"{name:8s} decode step: best {min(ts):.3f} ms, median {statistics.median(ts):.3f} ms")
    ratio_best = min(times["compile"]) / min(times["graph"])
    ratio_med = statistics.median(times["compile"]) / statistics.median(times["graph"])
    print(f"graph tok/s / compile tok/s: best {ratio_best:.3f}, median {ratio_med:.3f}; "
          f"graph launches per step {plan.launches}, arena {plan.memory.arena_bytes} B, "
          f"{a.threads} threads, {a.dtype}, quantize {a.quantize}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
