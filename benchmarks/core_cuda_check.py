"""The core plan (CoreRunner, and LLM's paged core engine) on a CUDA GPU: what a GPU
session checks now that ``compile()`` and ``LLM`` run CUDA models on the core engine
(the hand-written runner's CUDA plans are gone). Nothing here runs without a GPU; CI
checks the same routing without one (tests/adapters/torch/models/test_cuda_core_plan.py:
CPU tensors standing for CUDA ones, Triton in its interpreter).

    python benchmarks/core_cuda_check.py             # checks + 1B bf16 timings (H200: a few min)
    python benchmarks/core_cuda_check.py --quick     # checks only

1. The Triton kernels on the device: ``pytest tests/core/backends/triton`` (their
   conftest runs them on CUDA when a GPU is present), the CUDA-only GraphOp tests, and
   test_cuda_core_plan.py on CUDA tensors (which Triton kernels compile()/LLM call,
   none falling back; LLM decode steps captured at opt_level 3).
2. Greedy tokens: ``compile()`` (the core engine) vs Hugging Face eager, a tiny seeded
   Llama / Qwen2 / Mistral in fp32 (TF32 off), a left-padded batch: equal. bf16: the
   count of equal tokens is printed (near ties may differ). Also ``quantize="w8"``:
   the count of tokens equal to the float model's.
3. The decode step captured as a CUDA graph (opt_level 3 = ``GraphOp(cuda_graph=True)``
   on the lowered model; the in-place form captures decode steps with the cache by
   reference): tokens equal to the uncaptured run (opt_level 2), one launch per step,
   a capture kept across steps (printed: captures made).
4. ``LLM`` on CUDA (paged core engine, opt_level 2 and 3): tokens equal to the CPU's.
5. Every fallback the torch backend logged ("kernel skipped"): expected none for
   RopeKVCache (paged by slot), PagedAttention (decode and prefill), RmsNorm.
6. Timings (``--quick`` skips): a ~1B Llama-architecture model (seeded random bf16
   weights), batch 1 and 16, prompt 16, 128 new tokens: tokens/s of HF eager, the
   core plan (opt_level 2), the core plan captured (opt_level 3); engines
   interleaved, median of 3; the fraction of HBM bandwidth the weights' bytes per
   step reach (``--hbm-tbs``, H200: 4.8 TB/s).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers as tf

ROOT = Path(__file__).resolve().parents[1]


def model(arch: str, dtype: torch.dtype, seed: int = 0, **size) -> torch.nn.Module:
    cfg_cls, model_cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                          "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                          "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[arch]
    kw = dict(hidden_size=256, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
              intermediate_size=512, vocab_size=1024, max_position_embeddings=4096,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "mistral":
        kw["sliding_window"] = 8
    kw.update(size)
    cfg = cfg_cls(**kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return model_cls(cfg).to("cuda", dtype).eval()


def prompts(lengths: list[int], vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), s), generator=g)
    mask = torch.zeros(len(lengths), s, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, s - n:] = 1
    return ids.cuda(), mask.cuda()


def compile_core(m: torch.nn.Module, captured: bool, **kw) -> torch.nn.Module:
    import atb_torch as atb
    from atb_torch.models.core_runner import CoreRunner

    fast = atb.compile(m, opt_level=3 if captured else 2, **kw)
    assert isinstance(fast.atb_runner, CoreRunner), type(fast.atb_runner)
    assert fast.atb_runner.op.cuda_graph is captured
    return fast


def greedy(m: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    return m.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                      min_new_tokens=n)


def check_kernels() -> bool:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/core/backends/triton",
                          "tests/core/graph/test_graph_op_cuda.py",
                          "tests/adapters/torch/models/test_cuda_core_plan.py"],
                         cwd=ROOT, env=env)
    print(f"[1] Triton kernels and CUDA GraphOp tests on the device: rc {res.returncode}")
    return res.returncode == 0


def check_tokens() -> bool:
    ok = True
    torch.backends.cuda.matmul.allow_tf32 = False
    for arch in ("llama", "qwen2", "mistral"):
        for dtype in (torch.float32, torch.bfloat16):
            m = model(arch, dtype)
            ids, mask = prompts([7, 4], m.config.vocab_size)
            want = greedy(m, ids, mask, 12)
            plain, cap = compile_core(m, False), compile_core(m, True)
            got, got_cap = greedy(plain, ids, mask, 12), greedy(cap, ids, mask, 12)
            form = cap.atb_runner.op._in_place
            captures = len(form._captured) if form else 0
            same = int((got == want).sum()), int((got_cap == got).sum()), want.numel()
            print(f"[2,3] {arch} {str(dtype)[6:]}: core == HF {same[0]}/{same[2]}, captured == "
                  f"core {same[1]}/{same[2]}, captures kept {captures}, launches per step "
                  f"{getattr(form, 'last_launches', None)}")
            if dtype == torch.float32:
                ok &= same[0] == same[2]
            ok &= same[1] == same[2] and captures >= 1
    m = model("llama", torch.bfloat16)
    ids, mask = prompts([7, 4], m.config.vocab_size)
    w8 = greedy(compile_core(m, False, quantize="w8"), ids, mask, 12)
    print(f"[2] llama bf16 w8: == bf16 {int((w8 == greedy(m, ids, mask, 12)).sum())}/{w8.numel()}")
    return ok


def check_llm() -> bool:
    from atb_torch.llm import LLM

    ok = True
    m = model("qwen2", torch.float16)
    ps = [[5, 17, 33, 9, 81], [44, 12], [7, 7, 100, 3, 19, 250, 61]]
    with LLM(m.cpu(), max_batch_size=4, block_size=16, num_blocks=16) as cpu:
        want = [o.token_ids for o in cpu.generate_outputs(ps, max_new_tokens=12,
                                                          ignore_eos=True)]
    m.cuda()
    runs = {}
    for opt in (2, 3):
        with LLM(m, device="cuda", opt_level=opt, max_batch_size=4, block_size=16,
                 num_blocks=16) as llm:
            runs[opt] = got = [o.token_ids for o in llm.generate_outputs(
                ps, max_new_tokens=12, ignore_eos=True)]
            form = llm.decoder._in_place
            captures = len(form._captured) if form else 0
        same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
        total = sum(map(len, want))
        print(f"[4] LLM cuda fp16 opt_level {opt}: == CPU {same}/{total}, captures {captures}")
        # fp16 near ties may differ from the CPU's kernels; a capture never may
        ok &= same >= 0.9 * total and (captures >= 1) == (opt == 3)
    return ok and runs[3] == runs[2]


def steps_per_s(fn, tokens: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return tokens / (time.perf_counter() - t)


def timings(hbm_tbs: float) -> None:
    size = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, intermediate_size=8192, vocab_size=32000)
    m = model("llama", torch.bfloat16, **size)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in m.named_parameters()
                       if "embed_tokens" not in n)
    engines = {"hf eager": m, "core": compile_core(m, False),
               "core captured": compile_core(m, True)}
    new = 128
    for batch in (1, 16):
        ids, mask = prompts([16] * batch, size["vocab_size"])
        runs: dict[str, list[float]] = {k: [] for k in engines}
        for _ in range(3):  # interleaved
            for name, e in engines.items():
                runs[name].append(steps_per_s(lambda: greedy(e, ids, mask, new), new))
        for name, r in runs.items():
            steps = statistics.median(r)
            print(f"[6] batch {batch} {name}: {steps * batch:.1f} tok/s, {steps:.1f} steps/s, "
                  f"HBM {weight_bytes * steps / (hbm_tbs * 1e12):.1%}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="checks only, no timings")
    ap.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM bandwidth, TB/s")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to check")
        return 2
    skipped: list[str] = []

    class Fallbacks(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "kernel skipped" in record.getMessage():
                skipped.append(record.getMessage())
    log = logging.getLogger("atb")
    log.addHandler(Fallbacks(logging.INFO))
    log.setLevel(logging.INFO)
    ok = check_kernels()
    ok &= check_tokens()
    ok &= check_llm()
    print("[5] fallbacks logged:", *sorted(set(skipped)) or ["none"], sep="\n    ")
    if not args.quick:
        timings(args.hbm_tbs)
    print("ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
