"""Decoder benchmark: greedy generation with HF eager, atb and optional baselines on
the same weights and prompts, interleaved in one process (medians).

Per engine: ``tokens_per_s`` (batch × new tokens / (prefill + decode)),
``decode_tokens_per_s`` (the tokens after the first / decode time), ``prefill_s``,
``launches_per_step`` (see :mod:`.measure`), ``aten_ops_per_step`` (the same
dispatch-level count for every engine), memory, and for atb the accuracy against HF
eager: ``max_abs_logits_diff`` and ``logits_cosine_min`` over the prefill and every
decode step (atb fed HF's tokens), and ``tokens_match`` (its own greedy tokens)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

# the greedy token as atb's own ``generate`` picks it: one C call on CPU logits, as
# llama.cpp's loop here picks with NumPy's argmax rather than a torch op
from ...models.sample_step import _argmax
from .hf import DecodeRun, StaticCompiled, hf_greedy
from .measure import allocator_peak, count_ops, interleaved, median, read_bandwidth, \
    resident_bytes, weight_matmul_floor

__all__ = ["DecoderSettings", "AtbDecoder", "bench_decoder", "decode_weights"]

Progress = Callable[[str, int], Callable[[], None]]


@dataclass
class DecoderSettings:
    """What to run: ``batch`` rows of ``prompt_len`` random tokens, ``new_tokens``
    greedy tokens; ``dtype`` of the baselines, ``atb_dtype`` of atb (None = dtype,
    bf16 under w8), ``quantize``; ``repeats`` timed rounds after ``warmup``;
    ``baselines``: extra engines ("torch.compile", "llama.cpp"); ``gguf_types``: the
    llama.cpp precisions run (None = all of :data:`.llamacpp.GGUF_TYPES`)."""

    batch: int = 1
    prompt_len: int = 128
    new_tokens: int = 64
    dtype: torch.dtype = torch.float32
    atb_dtype: torch.dtype | None = None
    quantize: str | None = None
    repeats: int = 5
    warmup: int = 1
    opt_level: int = 2
    seed: int = 0
    baselines: list[str] = field(default_factory=list)
    gguf_types: tuple[str, ...] | None = None

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.atb_dtype is not None:
            return self.atb_dtype
        return torch.bfloat16 if self.quantize == "w8" else self.dtype


class AtbDecoder:
    """atb's serving pair on a compiled model: ``runner.prefill`` then
    ``runner.decode`` (the prebuilt decode plan) over a preallocated cache."""

    def __init__(self, model: Any, s: DecoderSettings) -> None:
        from ...models.compile import compile as atb_compile

        t0 = time.perf_counter()
        self.compiled = atb_compile(model, opt_level=s.opt_level, dtype=s.compute_dtype,
                                    quantize=s.quantize)
        self.runner = self.compiled.atb_runner
        self.cache = self.runner.new_cache(s.batch, s.prompt_len + s.new_tokens + 1)
        self.compile_s = time.perf_counter() - t0

    def greedy(self, ids: torch.Tensor, new_tokens: int, record: bool = False,
               forced: torch.Tensor | None = None) -> DecodeRun:
        r, cache = self.runner, self.cache
        seen: list[torch.Tensor] = []
        with torch.inference_mode():
            cache.reset()
            t0 = time.perf_counter()
            logits = r.prefill(ids, cache)
            nxt = _argmax(logits) if forced is None else forced[:, 0]
            if record:
                seen.append(logits.float().clone())
            toks = [nxt]
            t1 = time.perf_counter()
            for i in range(1, new_tokens):
                logits = r.decode(nxt, cache)
                nxt = _argmax(logits) if forced is None else forced[:, i]
                if record:
                    seen.append(logits.float().clone())
                toks.append(nxt)
            t2 = time.perf_counter()
        return DecodeRun(torch.stack(toks, 1), t1 - t0, t2 - t1, seen)

    def decode_step(self, ids: torch.Tensor) -> Callable[[], Any]:
        """One decode step after a fresh prefill (for op counting)."""
        self.cache.reset()
        with torch.inference_mode():
            nxt = self.runner.prefill(ids, self.cache).argmax(-1)

        def step() -> Any:
            with torch.inference_mode():  # the plan's buffers were made in inference mode
                return self.runner.decode(nxt, self.cache)
        return step

    def launches_per_step(self) -> int | None:
        """The decode plan's own launch count (None if the step ran unplanned)."""
        own = getattr(self.runner, "launches", None)  # the core engine's bound program
        if own:
            return own
        plans = getattr(self.cache, "plans", None) or {}
        counts = [p.launches for p in plans.values() if p is not None]
        return counts[-1] if counts else None




def decode_weights(model: Any) -> list[torch.Tensor]:
    """Every weight matrix one decode step multiplies by: the layers' Linears (expert
    weights of MoE models included) and the LM head; embeddings are gathers, not
    matmuls."""
    head = model.get_output_embeddings()
    ws = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head]
    return ws + ([head.weight] if head is not None else [])


def _hf_decode_step(model: Any, ids: torch.Tensor) -> Callable[[], Any]:
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        nxt = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1)

    def step() -> Any:
        with torch.inference_mode():
            return model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
    return step


def _accuracy(ref: DecodeRun, got: DecodeRun) -> dict[str, float]:
    diffs, coss = [], []
    for a, b in zip(ref.logits, got.logits):
        diffs.append(float((a - b).abs().max()))
        coss.append(float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).min()))
    return {"max_abs_logits_diff": max(diffs), "logits_cosine_min": min(coss),
            "logits_abs_max": max(float(a.abs().max()) for a in ref.logits)}


def _summary(runs: list[tuple[float, DecodeRun]], batch: int, new_tokens: int) -> dict[str, Any]:
    dec = [r.decode_s for _, r in runs]
    tot = [r.total_s for _, r in runs]
    return {"status": "ok", "tokens_per_s": batch * new_tokens / median(tot),
            "decode_tokens_per_s": batch * (new_tokens - 1) / median(dec) if new_tokens > 1
            else None,
            "prefill_s": median(r.prefill_s for _, r in runs), "decode_s": median(dec),
            "times_s": [round(t, 6) for t in tot]}


def bench_decoder(model: Any, s: DecoderSettings, progress: Progress | None = None) -> dict:
    """Run the decoder benchmark on ``model`` (an HF causal LM in ``s.dtype``)."""
    tick = progress or (lambda name, total: (lambda: None))
    gen = torch.Generator().manual_seed(s.seed)
    ids = torch.randint(0, model.config.vocab_size, (s.batch, s.prompt_len), generator=gen)
    model = model.to(s.dtype).eval()
    n = s.new_tokens

    atb = AtbDecoder(model, s)
    engines: dict[str, Callable[[], DecodeRun]] = {
        "hf_eager": lambda: hf_greedy(model, ids, n), "atb": lambda: atb.greedy(ids, n)}
    extra: dict[str, dict] = {}
    static = None
    if "torch.compile" in s.baselines:
        static = StaticCompiled(model, s.batch, s.prompt_len + n + 1)
        step = tick("torch.compile: compiling", 1)
        static.greedy(ids, n)
        step()
        engines["torch_compile"] = lambda: static.greedy(ids, n)
    lcpp: dict[str, Any] = {}
    if "llama.cpp" in s.baselines:
        from .llamacpp import GGUF_TYPES, LlamaCppDecoder

        types = s.gguf_types or GGUF_TYPES
        step = tick("llama.cpp: converting to GGUF", len(types))
        for qt in types:
            name = f"llama_cpp_{qt.lower()}"
            lc = LlamaCppDecoder.create(model, qt, s.batch, s.prompt_len + n + 8)
            step()
            if isinstance(lc, dict):
                extra[name] = lc
                if lc["status"].startswith("not installed"):
                    break  # one line says it for all three
            else:
                lcpp[name] = lc
                engines[name] = (lambda d: lambda: d.greedy(ids, n))(lc)

    step = tick(f"decoding {s.prompt_len}+{n} tokens x{s.batch}",
                (s.repeats + s.warmup) * len(engines))
    timed = interleaved(engines, s.repeats, s.warmup, on_step=lambda _: step())
    runs = {name: _summary(timed[name], s.batch, n) for name in engines}

    # accuracy: HF's logits along its own greedy path, atb teacher-forced on it
    step = tick("accuracy and counts", 5)
    ref = hf_greedy(model, ids, n, record=True)
    got = atb.greedy(ids, n, record=True, forced=ref.tokens)
    own = atb.greedy(ids, n)
    runs["atb"].update(_accuracy(ref, got), tokens_match=bool(torch.equal(own.tokens, ref.tokens)),
                       compile_s=atb.compile_s)
    step()
    hf_ops = count_ops(_hf_decode_step(model, ids))
    atb_ops = count_ops(atb.decode_step(ids))
    runs["hf_eager"].update(launches_per_step=hf_ops.compute, aten_ops_per_step=hf_ops.compute,
                            aten_views_per_step=hf_ops.views)
    runs["atb"].update(launches_per_step=atb.launches_per_step() or atb_ops.compute,
                       aten_ops_per_step=atb_ops.compute, aten_views_per_step=atb_ops.views)
    step()
    hf_res = resident_bytes(model)
    hf_peak = allocator_peak(lambda: hf_greedy(model, ids, n))
    step()
    atb_res = resident_bytes(atb.runner, atb.cache)
    atb_peak = allocator_peak(lambda: atb.greedy(ids, n))
    step()
    for name, res, peak in (("hf_eager", hf_res, hf_peak), ("atb", atb_res, atb_peak)):
        runs[name].update(resident_bytes=res, transient_peak_bytes=peak,
                          peak_memory_bytes=res + peak)
    if static is not None:
        runs["torch_compile"].update(compile_s=static.compile_s)
    for name, lc in lcpp.items():
        runs[name].update(convert_s=lc.convert_s,
                          tokens_match=bool(torch.equal(timed[name][-1][1].tokens, ref.tokens)),
                          **_accuracy(ref, lc.greedy(ids, n, record=True, forced=ref.tokens)))
    for name, info in extra.items():
        runs[name] = info
    floor = weight_matmul_floor(decode_weights(model), s.batch, s.compute_dtype, s.quantize,
                                repeats=3 if s.repeats <= 3 else 5)
    step()
    floor["tokens_per_s"] = s.batch / floor["seconds"]
    read = read_bandwidth(detail=True)
    floor.update(read_gbps=read["gbps"], read_bytes=read["bytes"], read_method=read["method"],
                 read_threads=read["threads"])
    floor["bandwidth_tokens_per_s"] = s.batch * floor["read_gbps"] * 1e9 / floor["bytes"]
    hf, ours = runs["hf_eager"], runs["atb"]
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "runs": runs,
        "speedup": ours["tokens_per_s"] / hf["tokens_per_s"],
        "decode_speedup": (ours["decode_tokens_per_s"] / hf["decode_tokens_per_s"]
                           if hf["decode_tokens_per_s"] else None),
        "launch_ratio": ours["launches_per_step"] / hf["launches_per_step"],
        "max_abs_logits_diff": ours["max_abs_logits_diff"],
        "weight_matmul_floor": floor,
        "floor_fraction": (ours["decode_tokens_per_s"] / floor["tokens_per_s"]
                           if ours["decode_tokens_per_s"] else None),
    }
