"""``LLM``: generate text from a local Hugging Face checkpoint with atb.

    llm = LLM("path/to/checkpoint")                   # safetensors + tokenizer, local only
    llm.generate("Once upon a time", max_new_tokens=32)           # -> str
    llm.generate(["a", "b", "c"], max_new_tokens=32, temperature=0.8, top_p=0.9, seed=1)
    for ev in llm.stream("Hello", max_new_tokens=16):             # tokens as they come
        print(ev.text, end="", flush=True)
    llm.last_stats.acceptance_rate                                # with enable_speculative

The model is compiled once (``atb_torch.compile``: fused blocks, prepared weights);
requests are served by continuous batching over a paged KV cache with prefix caching
(see :mod:`.engine`), run by one engine thread (:mod:`.loop`) that every call is a
client of: calls from several threads at once are batched together, each getting
exactly the tokens it would get alone. Greedy decoding (``temperature=0``, the default) gives exactly
the tokens the model's argmax gives; sampling is reproducible for a ``seed`` and
independent of which other prompts share the batch.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Any, Iterator, Sequence

import torch

from atbcore.errors import ParamsError
from atbcore.progress import progress
from atbcore.serving.engine import Engine
from atbcore.serving.front import LLMFront
from atbcore.serving.paged_model import PagedDecoder

from ..devices import resolve_device
from .checkpoint import load_checkpoint
from .detok import Detokenizer
from .engine import core_runner
from .loop import EngineLoop, RequestHandle, finish_pending
from .outputs import GenerationStats, TokenEvent
from .request import Request, SpecConfig
from .sampling import SamplingConfig

__all__ = ["LLM"]

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def _dtype(d: Any) -> torch.dtype | None:
    if d is None or isinstance(d, torch.dtype):
        return d
    try:
        return _DTYPES[str(d).lower()]
    except KeyError:
        raise ParamsError("LLM", "dtype", sorted(_DTYPES), repr(d)) from None


class LLM(LLMFront):
    """Text generation from a local checkpoint directory (see the module docstring).

    ``model``: a checkpoint directory (``config.json``, ``*.safetensors``, tokenizer
    files; pickle ``.bin`` weights are refused) — or an already loaded causal LM with
    ``tokenizer=`` (or none: then prompts are token-id lists and texts are empty).
    ``dtype`` (``"fp32"``, ``"bf16"``, ``"fp16"`` or a torch dtype; default: the
    checkpoint's), ``quantize`` None | ``"w8"`` | ``"w4"`` | ``"w8a8"``, ``enable_prefix_caching``,
    ``enable_speculative`` (prompt-lookup drafts of ``num_speculative_tokens``).
    Serving limits: ``max_batch_size`` running sequences, ``max_prefill_tokens`` per
    prefill step, the KV cache as ``num_blocks`` blocks of ``block_size`` tokens
    (default: room for ``max_batch_size`` full-length sequences within
    ``kv_cache_memory`` bytes). ``tensor_parallel_size`` N > 1: the checkpoint
    sharded over N ranks that this call starts (or those of ``torchrun``), see
    :mod:`.tp`. On every device (CPU, CUDA, NPU) the engine runs the core lowered
    decoder over the paged cache, as MindSpore's and Paddle's ``LLM`` do
    (:func:`.engine.core_runner`): ``opt_level`` 3 on CUDA replays decode steps as
    captured CUDA graphs."""

    def __new__(cls, *args: Any, tensor_parallel_size: int = 1, **kwargs: Any) -> "LLM":
        from .tp import TensorParallelLLM, check_tensor_parallel_size

        if check_tensor_parallel_size(tensor_parallel_size) > 1 and cls is LLM:
            cls = TensorParallelLLM  # sharded over ranks (.tp); the same methods
        return super().__new__(cls)

    def __init__(self, model: str | os.PathLike | Any, device: str = "cpu", dtype: Any = None,
                 quantize: str | None = None, enable_prefix_caching: bool = True,
                 enable_speculative: bool = False, *, tokenizer: Any = None,
                 opt_level: int = 2, max_batch_size: int = 32, max_prefill_tokens: int = 4096,
                 block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory: int = 256 * 2**20, num_speculative_tokens: int = 4,
                 max_model_len: int | None = None, tensor_parallel_size: int = 1) -> None:
        if quantize not in (None, "w8", "w4", "w8a8"):
            raise ParamsError("LLM", "quantize", "None, 'w8', 'w4' or 'w8a8'", repr(quantize))
        tdtype = _dtype(dtype)
        device = resolve_device(device, "LLM")  # before any weights move: a DeviceError, not torch's
        if isinstance(model, (str, os.PathLike)):
            hf, tok = load_checkpoint(model, dtype=tdtype, device=device)
            self.path = str(model)
        else:
            hf, tok, self.path = model, tokenizer, None
        self.tokenizer = tok if tokenizer is None else tokenizer
        self.config = hf.config
        with progress(f"atb: compiling {type(hf).__name__}"):  # a terminal only, after 2 s
            core = core_runner(hf, device, tdtype, quantize, opt_level)
        self.device, self.dtype = core.device, core.dtype
        spec = self.spec = core.spec
        self.vocab_size = core.vocab_size
        self.max_model_len = max_model_len or getattr(hf.config, "max_position_embeddings", None)
        self.eos_ids = self._eos_ids(hf)
        del hf  # the decoder's layers hold what they need
        from atbcore.memory import PagedKVCache

        per_block = 2 * spec.num_layers * block_size * spec.kv_size * \
            torch.empty((), dtype=self.dtype).element_size()
        if num_blocks is None:
            want = -(-max_batch_size * (self.max_model_len or 2048) // block_size)
            num_blocks = max(1, min(want, kv_cache_memory // per_block))
        self.cache = PagedKVCache(spec.num_layers, num_blocks, block_size, spec.num_kv_heads,
                                  spec.head_dim, dtype=self.dtype, device=str(self.device),
                                  enable_prefix_caching=enable_prefix_caching)
        self.enable_speculative = enable_speculative
        spec_cfg = SpecConfig(num_speculative_tokens) if enable_speculative else None
        self.decoder = core.op
        model = PagedDecoder(core.op, self.cache, "torch", self.vocab_size)
        self.engine = Engine(model, self.cache, max_batch_size, max_prefill_tokens,
                             self.max_model_len, spec_cfg)
        self.loop = EngineLoop(self.engine)
        # the cache's memory comes from atb's pool: give it back (after stopping the
        # engine thread) when the LLM goes away
        self._finalizer = weakref.finalize(self, _shut_down, self.loop, self.cache)
        self.last_stats = GenerationStats()

    @staticmethod
    def _eos_ids(hf: Any) -> frozenset[int]:
        ids: set[int] = set()
        for cfg in (getattr(hf, "generation_config", None), hf.config):
            e = getattr(cfg, "eos_token_id", None) if cfg is not None else None
            if e is not None:
                ids.update([e] if isinstance(e, int) else e)
        return frozenset(ids)

    # ------------------------------------------------------------------ API
    def submit(self, prompts: Any, sampling: SamplingConfig | None = None,
               max_new_tokens: int = 64, stop: str | Sequence[str] | None = None,
               ignore_eos: bool = False, n: int = 1,
               stats: GenerationStats | None = None, sink: Any = None) -> RequestHandle:
        """Start ``n`` completions of each prompt (one prompt, or a list) and return at
        once; iterate the handle for ``(request, TokenEvent)`` pairs, where
        ``event.index`` is ``prompt_index * n + choice`` and draws from that stream of
        ``sampling.seed`` (so ``n=1`` samples what :meth:`generate` samples); cancel
        with ``llm.cancel(handle)``. Safe from any thread; what the server uses (with
        an :class:`~.loop.AsyncSink` as ``sink`` to await events in asyncio)."""
        sampling = sampling or SamplingConfig()
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ParamsError("LLM.submit", "n", "an int >= 1", repr(n))
        stats = stats if stats is not None else GenerationStats()
        base = self._requests(prompts, max_new_tokens, stop, ignore_eos, sampling, stats)
        reqs = [Request(b.index * n + j, list(b.prompt), max_new_tokens, b.eos,
                        Detokenizer(self.tokenizer, b.detok.stop), sampling=sampling,
                        stats=stats, key=(sampling.seed, b.index * n + j))
                for b in base for j in range(n)]
        stats.requests += len(reqs)
        stats.prompt_tokens += sum(len(r.prompt) for r in reqs)
        return self.loop.submit(reqs, sink)

    def cancel(self, handle: RequestHandle, wait: bool = True) -> None:
        """Stop ``handle``'s unfinished requests; with ``wait`` their KV blocks are free
        on return (else at the engine's next step)."""
        finish_pending(self.loop, [handle], wait)

    def _drain(self, reqs: list[Request]) -> Iterator[TokenEvent]:
        stats = reqs[0].stats
        t0 = time.perf_counter()
        handle = self.loop.submit(reqs)
        try:
            for _, ev in handle:
                stats.elapsed_s = time.perf_counter() - t0
                yield ev
        finally:  # a consumer that stops early must not leak KV blocks
            finish_pending(self.loop, [handle])
            stats.elapsed_s = time.perf_counter() - t0

    def explain(self) -> str:
        """What the engine's model runs: the core decoder's plan report (nodes before
        and after fusion, kernels, weight layouts, arena, launches)."""
        return (self.decoder._in_place or self.decoder).explain()

    def close(self) -> None:
        """Stop the engine thread and free the KV cache now (also done when the LLM is
        garbage-collected)."""
        self.loop.close()
        self._finalizer()

    def __repr__(self) -> str:
        s = self.spec
        return (f"LLM({self.path or s.arch}, {s.num_layers} layers, {self.dtype}, "
                f"{self.device}, cache={self.cache})")


def _shut_down(loop: EngineLoop, cache: Any) -> None:
    loop.close()
    cache.destroy()
