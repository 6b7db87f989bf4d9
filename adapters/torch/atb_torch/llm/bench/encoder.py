"""Encoder benchmark: all-MiniLM-L6-v2 through sentence-transformers' own ``encode``
(its length sorting, batch 32), unaccelerated vs compiled by atb (and ONNX Runtime's
transformer-optimized export when ``onnxruntime`` is installed), interleaved in one
process. Reported: sentences/s, aten ops per batch of 32, memory, and the
embeddings' max |Δ| and minimum cosine against the unaccelerated model."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .measure import allocator_peak, count_ops, interleaved, median, resident_bytes

__all__ = ["EncoderSettings", "bench_encoder", "make_sentences"]

Progress = Callable[[str, int], Callable[[], None]]

_WORDS = ("the of and to in is was for on that with as by at from his her an which this be "
          "are were have had not but they model fast kernel memory token layer attention graph "
          "cache batch vector weight sentence language machine learning inference engine "
          "Ascend transformer boost fused operator plan runtime").split()


def make_sentences(n: int, seed: int = 0, min_words: int = 3, max_words: int = 120) -> list[str]:
    """``n`` sentences of seeded random words, lengths spread over
    ``min_words..max_words`` (varied lengths exercise padding and sorting)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(min_words, max_words)
        out.append(" ".join(rng.choice(_WORDS) for _ in range(k)).capitalize() + ".")
    return out


@dataclass
class EncoderSettings:
    """``sentences`` to encode per run in batches of ``batch_size``; ``dtype`` of
    atb's compute (the baseline is the model as shipped, fp32); ``quantize`` atb's
    (``"w8a8"``: ONNX Runtime's model is then its dynamic int8 quantization);
    ``repeats`` rounds."""

    sentences: int = 1000
    batch_size: int = 32
    dtype: torch.dtype = torch.float32
    repeats: int = 5
    warmup: int = 1
    onnxruntime: bool = True
    quantize: str | None = None


def load_minilm(path: str) -> Any:
    """The sentence-transformers model from a local directory, with the hub offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path, device="cpu", local_files_only=True)


def bench_encoder(path: str, s: EncoderSettings, progress: Progress | None = None) -> dict:
    """Run the encoder benchmark on the model at ``path``."""
    from ...models.compile import compile as atb_compile

    tick = progress or (lambda name, total: (lambda: None))
    st = load_minilm(path)
    st.eval()
    t0 = time.perf_counter()
    fast = atb_compile(st, dtype=s.dtype if s.dtype != torch.float32 else None,
                       quantize=s.quantize)
    compile_s = time.perf_counter() - t0
    sents = make_sentences(s.sentences)

    def enc(model: Any) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with torch.inference_mode():
                return model.encode(sents, batch_size=s.batch_size, convert_to_tensor=True,
                                    show_progress_bar=False).float()
        return run

    engines: dict[str, Callable[[], Any]] = {"hf_eager": enc(st), "atb": enc(fast)}
    runs: dict[str, dict] = {}
    if not s.onnxruntime:
        runs["onnxruntime"] = {"status": "skipped (quick run: --baseline onnxruntime adds it)"}
    else:
        from .onnx_encoder import OrtEncoder

        ort = OrtEncoder.create(st, path, int8=s.quantize is not None)
        if isinstance(ort, dict):
            runs["onnxruntime"] = ort
        else:
            engines["onnxruntime"] = lambda: ort.encode(sents, s.batch_size)
    step = tick(f"encoding {s.sentences} sentences", (s.repeats + s.warmup) * len(engines))
    timed = interleaved(engines, s.repeats, s.warmup, on_step=lambda _: step())
    ref = timed["hf_eager"][-1][1]
    for name in engines:
        emb = timed[name][-1][1]
        cos = torch.nn.functional.cosine_similarity(emb.double(), ref.double(), dim=-1)
        runs[name] = {"status": "ok",
                      "sentences_per_s": s.sentences / median(t for t, _ in timed[name]),
                      "times_s": [round(t, 6) for t, _ in timed[name]],
                      "max_abs_diff": float((emb - ref).abs().max()),
                      "cosine_min": float(cos.min())}
    step = tick("encoder counts and memory", 2)
    batch = sents[:s.batch_size]
    for name, model in (("hf_eager", st), ("atb", fast)):
        def one(model: Any = model) -> Any:
            with torch.inference_mode():
                return model.encode(batch, batch_size=s.batch_size, convert_to_tensor=True,
                                    show_progress_bar=False)
        ops = count_ops(one)
        res = resident_bytes(model if name == "hf_eager" else _runners(model))
        peak = allocator_peak(enc(model))
        runs[name].update(launches_per_step=ops.compute, aten_ops_per_step=ops.compute,
                          resident_bytes=res, transient_peak_bytes=peak,
                          peak_memory_bytes=res + peak)
        step()
    runs["atb"]["compile_s"] = compile_s
    out = {"status": "ok", "sentences": s.sentences, "batch_size": s.batch_size, "runs": runs,
           "speedup": runs["atb"]["sentences_per_s"] / runs["hf_eager"]["sentences_per_s"],
           "max_abs_diff": runs["atb"]["max_abs_diff"], "cosine_min": runs["atb"]["cosine_min"]}
    if runs.get("onnxruntime", {}).get("status") == "ok":
        out["speedup_vs_onnxruntime"] = (runs["atb"]["sentences_per_s"]
                                         / runs["onnxruntime"]["sentences_per_s"])
    return out


def _runners(model: Any) -> list[Any]:
    """The atb runners inside a compiled sentence-transformers model."""
    return [m.atb_runner for m in model.modules() if hasattr(m, "atb_runner")]
