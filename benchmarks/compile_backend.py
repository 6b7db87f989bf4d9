"""Decode speed of ``torch.compile(hf_llama, backend="atb")`` and of
``attn_implementation="atb"`` against Hugging Face eager (not a timed test).

On ``atb bench``'s default model (fp32, batch 1, a 128-token prompt, 32 decode steps
over HF's DynamicCache, SDPA attention in the baseline), interleaved in one process,
medians: each engine prefills once and then steps one token at a time through the
model's own forward (the way ``generate`` calls it). "per-round" is the median over
rounds of HF's decode time / the engine's in the same round, which a load swing
between rounds on a shared machine does not tilt; "best" takes the fastest decode and
the fastest prefill (interference only adds time).

    python benchmarks/compile_backend.py [--repeats 5] [--steps 32] [--threads N] [--out results.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch

for _p in ("..", "../adapters/torch"):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), _p))

import atb_torch.dynamo_backend  # noqa: E402,F401  (registers backend "atb")
import atb_torch.models.hf_attention  # noqa: E402,F401  (registers attn_implementation "atb")
from atb_torch.llm.bench.measure import interleaved, median  # noqa: E402
from atb_torch.llm.bench.models import build_default_model  # noqa: E402


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    ap.add_argument("--inductor", action="store_true",
                    help="also backend='atb' with options={'inner': 'inductor'}")
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def main() -> int:
    a = parse()
    if a.threads:
        torch.set_num_threads(a.threads)
    model = build_default_model()
    model.set_attn_implementation("sdpa")
    # its own copy: a shallow copy shares the layers' config, so setting "atb" on it
    # switched the HF baseline's attention too
    atb_attn = copy.deepcopy(model)
    atb_attn.set_attn_implementation("atb")
    assert model.model.layers[0].self_attn.config._attn_implementation == "sdpa"
    compiled = torch.compile(model, backend="atb", dynamic=True)
    ids = torch.randint(3, model.config.vocab_size, (1, a.prompt),
                        generator=torch.Generator().manual_seed(0))

    def decode(m):
        def go():
            out = m(ids, use_cache=True)
            cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            toks = []
            for _ in range(a.steps):
                out = m(tok, past_key_values=cache, use_cache=True)
                cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
                toks.append(int(tok))
            return toks
        return go

    def prefill(m):
        return lambda: m(ids, use_cache=True)

    engines = {"HF eager (sdpa)": model, "torch.compile(backend='atb')": compiled,
               "attn_implementation='atb'": atb_attn}
    if a.inductor:
        engines["backend='atb' + inductor"] = torch.compile(
            model, backend="atb", dynamic=True, options={"inner": "inductor"})
    runs = {}
    for name, m in engines.items():
        runs[name] = decode(m)
        runs[name + " prefill"] = prefill(m)
    with torch.no_grad():
        for name in engines:  # compile prefill and the (dynamic) decode graph first
            if name.startswith(("torch.compile", "backend=")):
                runs[name]()
                runs[name]()
        timed = interleaved(runs, repeats=a.repeats, warmup=1)
    tok_s = {n: a.steps / (median(t for t, _ in timed[n]) - median(t for t, _ in
                                                                   timed[n + " prefill"]))
             for n in engines}
    decode = {n: [full - pre for (full, _), (pre, _) in zip(timed[n], timed[n + " prefill"])]
              for n in engines}
    paired = {n: median(h / t for h, t in zip(decode["HF eager (sdpa)"], decode[n]))
              for n in engines}
    # interference only adds time: the fastest decode minus the fastest prefill
    best = {n: a.steps / (min(t for t, _ in timed[n]) - min(t for t, _ in timed[n + " prefill"]))
            for n in engines}
    same = {n: timed[n][0][1] == timed["HF eager (sdpa)"][0][1] for n in engines}
    base = tok_s["HF eager (sdpa)"]
    print(f"default model, fp32, batch 1, prompt {a.prompt}, {a.steps} decode steps, "
          f"{torch.get_num_threads()} threads, median of {a.repeats} interleaved runs")
    print(f"{'engine':32s} {'decode tok/s':>12s} {'vs HF eager':>12s} {'per-round':>10s} "
          f"{'best ratio':>10s} {'same tokens':>12s}")
    hf_best = best["HF eager (sdpa)"]
    for n, v in tok_s.items():
        print(f"{n:32s} {v:12.1f} {v / base:12.3f} {paired[n]:10.3f} {best[n] / hf_best:10.3f} "
              f"{str(same[n]):>12s}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"tok_s": tok_s, "ratio_vs_hf_eager": {n: v / base for n, v in tok_s.items()},
                       "per_round_ratio_vs_hf_eager": paired, "best_tok_s": best,
                       "same_tokens": same, "prompt": a.prompt, "steps": a.steps,
                       "threads": torch.get_num_threads(), "repeats": a.repeats}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
