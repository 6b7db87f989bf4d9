"""``LLM`` for the MindSpore and Paddle front-ends: a local Hugging Face checkpoint,
loaded without torch, run on the core plan by that framework's backend.

    import atb_mindspore as atb                       # or atb_paddle
    llm = atb.LLM("path/to/checkpoint")               # safetensors + tokenizer, local only
    llm.generate("Once upon a time", max_new_tokens=32)               # -> str
    llm.generate(["a", "b"], max_new_tokens=8, temperature=0.8, seed=1)   # -> [str, str]
    for ev in llm.stream("Hello", max_new_tokens=16):                 # TokenEvents
        print(ev.text, end="")

The checkpoint's tensors are memory-mapped into NumPy (:mod:`atbcore.models.checkpoint`),
lowered to one core GraphOp (:func:`atbcore.models.decoder.decoder_layers`: fused
norms, merged QKV, RoPE with the in-place cache write), and run with the ids as the
front-end's tensors, so its backend (and the C kernels it binds through DLPack) runs
the plan. ``generate`` / ``stream`` / ``generate_outputs`` take ``atb_torch.LLM``'s
arguments and return its types; greedy decoding gives the argmax tokens, and seeded
sampling draws the tokens ``atb_torch.LLM`` draws for the same seed (the same
per-token seed and ``TopkToppSampling`` op). Requests are served by
:class:`~.decode_loop.DecodeLoop` (continuous batching over the rows of a contiguous
KV cache); what it does not do yet is listed there.
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterator, Sequence

import numpy as np

from ..dtypes import Dtype
from ..errors import CapabilityError, InputError, ParamsError
from ..graph.graph_op import GraphOp
from ..memory import KVCache
from ..models.arch import resolve_architecture
from ..models.checkpoint import (check_checkpoint_dir, eos_token_ids, load_config, load_tensors,
                                 load_tokenizer, weights_from_tensors)
from ..models.decoder import decoder_layers, why_not_lowered
from .decode_loop import DecodeLoop
from .detok import Detokenizer
from .outputs import GenerationStats, RequestOutput, TokenEvent
from .request import Request
from .row_feeder import RowFeeder
from .sampling_config import SamplingConfig

__all__ = ["HostLLM"]

_DTYPES = {"fp32": Dtype.FP32, "float32": Dtype.FP32, "bf16": Dtype.BF16,
           "bfloat16": Dtype.BF16, "fp16": Dtype.FP16, "float16": Dtype.FP16}


def _cast(tensors: dict[str, np.ndarray], dtype: Dtype | None) -> dict[str, np.ndarray]:
    if dtype is None:
        return tensors
    return {k: (v.astype(dtype.numpy) if Dtype.of(v.dtype).is_floating and
                Dtype.of(v.dtype) != dtype else v) for k, v in tensors.items()}


class HostLLM:
    """Text generation from a local checkpoint directory on ``framework``'s backend
    (see the module docstring). ``dtype``: ``"fp32"``, ``"bf16"``, ``"fp16"`` (default:
    the checkpoint's); ``max_batch_size`` running requests (others wait for a free
    row), limited to what fits in ``kv_cache_memory`` bytes of KV cache;
    ``max_model_len`` tokens per request (default: the config's
    ``max_position_embeddings``, at most 2048)."""

    framework = "numpy"
    who = "LLM"

    def __init__(self, model: str | os.PathLike, device: str = "cpu", dtype: Any = None, *,
                 tokenizer: Any = None, max_batch_size: int = 8, max_model_len: int | None = None,
                 kv_cache_memory: int = 256 * 2**20) -> None:
        if device != "cpu":
            raise ParamsError(self.who, "device", "'cpu' (the C kernels' device)", repr(device))
        if dtype is not None and str(dtype).lower() not in _DTYPES:
            raise ParamsError(self.who, "dtype", sorted(_DTYPES), repr(dtype))
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) \
                or max_batch_size < 1:
            raise ParamsError(self.who, "max_batch_size", "an int >= 1", repr(max_batch_size))
        d = check_checkpoint_dir(model, self.who)
        self.path = str(model)
        self.config = load_config(d, self.who)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(d, self.who)
        self.spec = spec = resolve_architecture(self.config).describe(self.config)
        why = why_not_lowered(spec)
        if why:
            raise CapabilityError(self.who, why, "a Llama-family decoder", spec.arch)
        tensors = _cast(load_tensors(d), None if dtype is None else _DTYPES[str(dtype).lower()])
        weights = weights_from_tensors(spec, tensors, self.config, self.who)
        self.dtype = Dtype.of(np.asarray(weights.embed).dtype)
        self.vocab_size = int(weights.embed.shape[0])
        self.op = GraphOp(decoder_layers(spec, weights), name=spec.arch)
        del tensors, weights
        mpe = getattr(self.config, "max_position_embeddings", None) or 2048
        self.max_model_len = int(max_model_len or min(mpe, 2048))
        per_row = 2 * spec.num_layers * self.max_model_len * spec.kv_size * self.dtype.itemsize
        rows = max(1, min(max_batch_size, kv_cache_memory // per_row))
        self.cache = KVCache(spec.num_layers, rows, self.max_model_len, spec.num_kv_heads,
                             spec.head_dim, dtype=self.dtype)
        self.loop = DecodeLoop(RowFeeder(self.op, self.cache, self.framework, self.vocab_size), self.max_model_len)
        self.eos_ids = eos_token_ids(d, self.config)
        self.last_stats = GenerationStats()

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids (a string through the tokenizer; ids checked against
        the vocabulary)."""
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt).input_ids
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InputError("LLM.generate", "prompt", "at least one token", "an empty prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InputError("LLM.generate", "prompt token ids", f"in [0, {self.vocab_size})",
                             bad[:5])
        if len(ids) >= self.max_model_len:
            raise InputError("LLM.generate", "prompt length",
                             f"< max_model_len {self.max_model_len}", len(ids))
        return list(ids)

    def _prepare(self, prompts: Any, max_new_tokens: int, temperature: float, top_k: int,
                 top_p: float, seed: Any, stop: Any, ignore_eos: bool,
                 sampling: dict[str, Any]) -> list[Request]:
        single = isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int))
        items = [prompts] if single else list(prompts)
        if not items:
            raise InputError("LLM.generate", "prompts", "a prompt or a non-empty list", "[]")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or \
                max_new_tokens < 1:
            raise ParamsError("LLM.generate", "max_new_tokens", "an int >= 1",
                              repr(max_new_tokens))
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if not all(isinstance(s, str) for s in stops):
            raise ParamsError("LLM.generate", "stop", "a string or a list of strings", repr(stop))
        seeds = None if isinstance(seed, int) and not isinstance(seed, bool) else list(seed)
        if seeds is not None and (len(seeds) != len(items) or any(
                isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds)):
            raise ParamsError("LLM.generate", "seed", f"an int or {len(items)} ints >= 0 "
                              "(one per prompt)", seeds)
        cfg = SamplingConfig(temperature, top_k, top_p, seed if seeds is None else 0, **sampling)
        stats = GenerationStats()
        eos = frozenset() if ignore_eos else self.eos_ids
        reqs = []
        for i, p in enumerate(items):
            # a list's prompts draw from streams 0, 1, ... (as atb_torch.LLM's do)
            key = (seed, i) if seeds is None else (seeds[i], 0)
            reqs.append(Request(i, self.encode(p), max_new_tokens, eos,
                                Detokenizer(self.tokenizer, stops), key=key, sampling=cfg,
                                stats=stats))
        stats.requests = len(reqs)
        stats.prompt_tokens = sum(len(r.prompt) for r in reqs)
        self.last_stats = stats
        return reqs

    def _drain(self, reqs: list[Request]) -> Iterator[TokenEvent]:
        stats = reqs[0].stats
        t0 = time.perf_counter()
        run = self.loop.run(reqs)
        try:
            for _, ev in run:
                stats.elapsed_s = time.perf_counter() - t0
                yield ev
        finally:
            run.close()
            stats.elapsed_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ API
    def stream(self, prompts: Any, max_new_tokens: int = 64, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: Any = 0, stop: Any = None,
               ignore_eos: bool = False, **sampling: Any) -> Iterator[TokenEvent]:
        """Yield :class:`TokenEvent` s as tokens are produced (``event.index`` says
        which prompt of a list); the tokens :meth:`generate` returns."""
        reqs = self._prepare(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop,
                             ignore_eos, sampling)
        yield from self._drain(reqs)

    def generate_outputs(self, prompts: Any, max_new_tokens: int = 64, temperature: float = 0.0,
                         top_k: int = 0, top_p: float = 1.0, seed: Any = 0, stop: Any = None,
                         ignore_eos: bool = False, **sampling: Any) -> list[RequestOutput]:
        """Like :meth:`generate`, a :class:`RequestOutput` per prompt, in prompt order."""
        reqs = self._prepare(prompts, max_new_tokens, temperature, top_k, top_p, seed, stop,
                             ignore_eos, sampling)
        for _ in self._drain(reqs):
            pass
        return [RequestOutput(r.index, r.prompt, list(r.output), r.detok.text, r.finish_reason,
                              0, r.error,
                              list(r.logprobs) if r.sampling.logprobs is not None else None)
                for r in reqs]

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: Any = 0, stop: str | Sequence[str] | None = None,
                 ignore_eos: bool = False, **sampling: Any) -> str | list[str]:
        """Generated text for one prompt (a ``str`` back) or a list (a list back);
        the arguments of ``atb_torch.LLM.generate``."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int))
        outs = self.generate_outputs(prompts, max_new_tokens, temperature, top_k, top_p, seed,
                                     stop, ignore_eos, **sampling)
        texts = [o.text for o in outs]
        return texts[0] if single else texts

    @property
    def stats(self) -> GenerationStats:
        """Statistics of the last ``generate`` / ``stream`` call."""
        return self.last_stats

    def close(self) -> None:
        """Free the KV cache and the plans now."""
        self.op.destroy()
        self.cache.free()

    def __enter__(self) -> "HostLLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.spec
        return (f"{type(self).__module__.split('.')[0]}.LLM({self.path}, {s.num_layers} layers, "
                f"{self.dtype.name}, {self.framework}, rows={self.cache.max_batch})")
