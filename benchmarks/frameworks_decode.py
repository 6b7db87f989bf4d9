"""Decode tokens/s of one checkpoint in ``atb_mindspore.LLM``, ``atb_paddle.LLM``,
``atb_torch.LLM`` and Hugging Face eager ``generate``, in one process.

The embedded default model's sizes (hidden 512, 8 layers, 8 heads, 2 KV heads, inter
1376, vocab 32000), seeded random fp32 weights saved as a local safetensors
checkpoint (with a word-level tokenizer); ``--batch`` prompts of 32 token ids. Each
sample streams ``--tokens`` greedy tokens (``ignore_eos``) from each engine in turn;
decode tokens/s = tokens after the first / time from the first token to the last
(Hugging Face: ``--tokens`` tokens minus one token, both timed). Medians of
``--samples`` samples and their ratios to atb_torch are printed.

``--plugin-check``: then, per engine, the same decode rate with a plugin module
registered that implements no hook (every sample of the engine alternates: with it,
without it) and the ratio of the medians: a plan with no plugin hook pays nothing
for the plugin points.

    python benchmarks/frameworks_decode.py [--samples 7] [--tokens 32] [--batch 1] [--plugin-check]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..")]

H, L, NH, KV, I, V = 512, 8, 8, 2, 1376, 32000


def save_checkpoint(path: str) -> None:
    """The default model (seeded) and a word-level tokenizer, as a local checkpoint."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=H, num_hidden_layers=L, num_attention_heads=NH,
                      num_key_value_heads=KV, intermediate_size=I, vocab_size=V,
                      max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w2").save_pretrained(path)


def stream_rate(llm, prompts, tokens: int) -> float:
    """Decode tokens/s of one ``stream`` call (first token excluded)."""
    first = last = None
    count = 0
    for ev in llm.stream(prompts, max_new_tokens=tokens, ignore_eos=True):
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            count += len(ev.token_ids)
        last = now
    return count / (last - first)


def hf_rate(model, ids, tokens: int) -> float:
    import torch

    def run(n: int) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
        return time.perf_counter() - t0
    return ids.shape[0] * (tokens - 1) / (run(tokens) - run(1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--plugin-check", action="store_true")
    a = ap.parse_args(argv)
    import mindspore  # noqa: F401  (MindSpore before Paddle in one process)
    import atb_mindspore
    import atb_paddle
    import torch
    from transformers import AutoModelForCausalLM

    import atb_torch

    d = tempfile.mkdtemp(prefix="atb-frameworks-decode-")
    save_checkpoint(d)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, V, (32,), generator=g).tolist() for _ in range(a.batch)]
    max_len = 32 + a.tokens + 8
    engines = {
        "mindspore": atb_mindspore.LLM(d, max_batch_size=a.batch, max_model_len=max_len),
        "paddle": atb_paddle.LLM(d, max_batch_size=a.batch, max_model_len=max_len),
        "atb_torch": atb_torch.LLM(d, max_batch_size=a.batch, max_model_len=max_len),
    }
    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    ids = torch.tensor(prompts)
    # same greedy tokens everywhere, checked once (a benchmark of wrong output is void)
    want = engines["atb_torch"].generate_outputs(prompts, max_new_tokens=8, ignore_eos=True)
    for name in ("mindspore", "paddle"):
        got = engines[name].generate_outputs(prompts, max_new_tokens=8, ignore_eos=True)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], name
    rates: dict[str, list[float]] = {n: [] for n in (*engines, "hf_eager")}
    for name, llm in engines.items():  # warm-up
        stream_rate(llm, prompts, 4)
    for _ in range(a.samples):
        for name, llm in engines.items():
            rates[name].append(stream_rate(llm, prompts, a.tokens))
        rates["hf_eager"].append(hf_rate(hf, ids, a.tokens))
    base = statistics.median(rates["atb_torch"])
    print(f"decode tokens/s, default model (hidden {H}, {L} layers), batch {a.batch}, "
          f"{a.tokens} tokens, median of {a.samples} interleaved samples, "
          f"{torch.get_num_threads()} torch threads")
    for name, r in rates.items():
        m = statistics.median(r)
        print(f"  {name:10s} {m:8.1f} tok/s   {m / base:5.2f}x atb_torch   "
              f"(min {min(r):.1f}, max {max(r):.1f})")
    if a.plugin_check:
        plugin_check(engines, prompts, a)
    return 0


def plugin_check(engines: dict, prompts: list, a: argparse.Namespace) -> None:
    """Decode rate with a hook-less plugin module registered / without, interleaved."""
    import types

    from atbcore.plugin import get_plugin_manager

    pm = get_plugin_manager()
    empty = types.ModuleType("atb_bench_empty_plugin")  # a plugin implementing no hook
    rates: dict[str, dict[bool, list[float]]] = {n: {True: [], False: []} for n in engines}
    for _ in range(a.samples):
        for name, llm in engines.items():
            for loaded in (True, False):
                if loaded:
                    pm.register(empty, name="atb_bench_empty_plugin")
                try:
                    rates[name][loaded].append(stream_rate(llm, prompts, a.tokens))
                finally:
                    if loaded:
                        pm.unregister(name="atb_bench_empty_plugin")
    print(f"decode with a plugin module loaded that registers no hook / without one "
          f"(median of {a.samples} interleaved pairs)")
    for name, r in rates.items():
        on, off = statistics.median(r[True]), statistics.median(r[False])
        print(f"  {name:10s} {on:8.1f} / {off:8.1f} tok/s   ratio {on / off:5.3f}")


if __name__ == "__main__":
    sys.exit(main())
