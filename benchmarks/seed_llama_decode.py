"""The seed's ``AcceleratedLLaMA`` (GraphOps + ``atb.KVCache``), compiled, against
``atb.compile`` of a Hugging Face Llama of the same size: decode tokens/s.

Both models: hidden 512, 8 layers, 8 heads, inter 1376, vocab 32000 (the embedded
default model's sizes; the seed block has full-head attention and a non-gated SiLU
MLP, the HF model GQA and SwiGLU, so the weights read per token differ a little:
both are reported). Greedy, batch 1, a 32-token prompt, ``--new`` tokens; the two
take turns, medians of ``--repeats`` runs.

    python benchmarks/seed_llama_decode.py [--new 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "tests", "adapters", "torch")]

import torch  # noqa: E402

import atb_torch as atb  # noqa: E402

H, L, NH, I, V = 512, 8, 8, 1376, 32000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--best", action="store_true",
                    help="report the best run of each instead of the median (a shared machine)")
    a = ap.parse_args(argv)
    from seed_models import AcceleratedLLaMA
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    seed = AcceleratedLLaMA(V, H, L, NH, I, max_batch=1,
                            max_seq_len=a.prompt + a.new + 1).eval()
    fast_seed = atb.compile(seed, mode="infer", opt_level=3)
    cfg = LlamaConfig(hidden_size=H, num_hidden_layers=L, num_attention_heads=NH,
                      num_key_value_heads=2, intermediate_size=I, vocab_size=V)
    hf = LlamaForCausalLM(cfg).eval()
    fast_hf = atb.compile(hf, opt_level=2)
    ids = torch.randint(3, V, (1, a.prompt), generator=torch.Generator().manual_seed(1))

    def run_seed() -> float:
        t0 = time.perf_counter()
        fast_seed.generate(ids, max_new_tokens=a.new)
        return a.new / (time.perf_counter() - t0)

    def run_hf() -> float:
        t0 = time.perf_counter()
        fast_hf.generate(ids, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False)
        return a.new / (time.perf_counter() - t0)

    run_seed(), run_hf()
    s, h = [], []
    for _ in range(a.repeats):
        s.append(run_seed())
        h.append(run_hf())
    stat = max if a.best else statistics.median
    ms, mh = stat(s), stat(h)
    print(f"seed AcceleratedLLaMA compiled: {ms:.1f} tok/s; compile(HF Llama): {mh:.1f} tok/s; "
          f"ratio {ms / mh:.3f} (target >= 0.85; {'best' if a.best else 'median'} of "
          f"{a.repeats})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
