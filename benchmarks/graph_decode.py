"""A Hugging Face Llama on the core engine, two ways, against Hugging Face eager on the
same model: decode step time, one process. Engines: "graph" (the lowered GraphOp
called with an ``atb.KVCache``, as a GraphOp user runs it), "core" (``atb.compile``'s
CoreRunner.decode, what compiled models and ``LLM`` run) and "hf" (the model's own
forward over its DynamicCache, the floor).

The embedded default model's sizes (hidden 512, 8 layers, 8 heads, 2 KV heads, inter
1376, vocab 32000), fp32 (or ``--dtype bf16``), batch 1, a 32-token prompt; each sample times ``--steps``
decode steps of one engine, the engines take turns, and the best and median per-step
times of ``--samples`` samples are reported with their ratio. Also: the graph's
launches per step and its arena bytes. ``--arch gpt2`` / ``qwen3``: the same sizes
as a GPT-2 (LayerNorm, learned positions, GELU MLP of inter 1376, MHA) or a Qwen3
(q/k norms). ``--quantize w8|w8a8|w4`` quantizes atb's Linears (HF stays float).

    python benchmarks/graph_decode.py [--samples 15] [--steps 16] [--threads 2] [--dtype bf16]
                                      [--arch llama|gpt2|qwen3] [--quantize w8|w8a8|w4]
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


def _model(arch: str):
    """The benchmark's Hugging Face model of ``arch`` and its cache's KV heads."""
    import transformers as tf

    if arch == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=H, n_layer=L, n_head=NH, n_inner=I,
                                                vocab_size=V, n_positions=1024)), NH
    cfg = {"llama": tf.LlamaConfig, "qwen3": tf.Qwen3Config}[arch](
        hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, num_key_value_heads=KV,
        intermediate_size=I, vocab_size=V, head_dim=H // NH)
    return {"llama": tf.LlamaForCausalLM, "qwen3": tf.Qwen3ForCausalLM}[arch](cfg), KV


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=15)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--arch", choices=("llama", "gpt2", "qwen3"), default="llama")
    ap.add_argument("--quantize", choices=("w8", "w8a8", "w4"), default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    import atb_torch as atb
    from atb_torch.models.lower import lower_decoder
    from atbcore.memory import KVCache

    torch.manual_seed(0)
    hf, kv = _model(a.arch)
    hf = hf.eval()
    if a.dtype == "bf16":
        hf = hf.to(torch.bfloat16)
    ids = torch.randint(3, V, (1, 32), generator=torch.Generator().manual_seed(1))
    cap = 32 + (a.samples + 1) * a.steps + 8
    op = lower_decoder(hf, quantize=a.quantize)
    cache = KVCache(L, 1, cap, kv, H // NH, dtype=a.dtype)
    core = atb.compile(hf, opt_level=2, quantize=a.quantize).atb_runner
    ccache = core.new_cache(1, cap)
    tok, rtok = ids[:, -1:], ids[0, -1:]
    with torch.no_grad():
        op(ids, kv_cache=cache)
        core.prefill(ids, ccache)
        past = hf(ids, use_cache=True).past_key_values
        engines = {"graph": lambda: op(tok, kv_cache=cache),
                   "core": lambda: core.decode(rtok, ccache),
                   "hf": lambda: hf(tok, past_key_values=past)}
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
    for name, base in (("graph", "core"), ("core", "hf"), ("graph", "hf")):
        ratio_best = min(times[base]) / min(times[name])
        ratio_med = statistics.median(times[base]) / statistics.median(times[name])
        print(f"{name} tok/s / {base} tok/s: best {ratio_best:.3f}, median {ratio_med:.3f}")
    print(f"graph launches per step {plan.launches}, arena {plan.memory.arena_bytes} B, "
          f"{a.threads} threads, {a.dtype}, {a.arch}, quantize {a.quantize}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
