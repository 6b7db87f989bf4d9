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
per-token seed and ``TopkToppSampling`` op). Requests are served by the engine
``atb_torch.LLM`` runs (:class:`~.engine.Engine`: continuous batching over a paged KV
cache, prefix caching, preemption, prompt-lookup speculation), stepped in the
caller's thread, on the lowered decoder run over the paged cache
(:class:`~.paged_model.PagedDecoder`).
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterator

import numpy as np

from ..dtypes import Dtype
from ..errors import CapabilityError, ParamsError
from ..graph.graph_op import GraphOp
from ..memory import PagedKVCache
from ..models.arch import resolve_architecture
from ..models.checkpoint import (check_checkpoint_dir, eos_token_ids, load_config, load_tensors,
                                 load_tokenizer, weights_from_tensors)
from ..models.decoder import decoder_layers, why_not_lowered
from .engine import Engine
from .front import LLMFront
from .outputs import GenerationStats, TokenEvent
from .paged_model import PagedDecoder
from .request import Request, SpecConfig

__all__ = ["HostLLM"]

_DTYPES = {"fp32": Dtype.FP32, "float32": Dtype.FP32, "bf16": Dtype.BF16,
           "bfloat16": Dtype.BF16, "fp16": Dtype.FP16, "float16": Dtype.FP16}


def _cast(tensors: dict[str, np.ndarray], dtype: Dtype | None) -> dict[str, np.ndarray]:
    if dtype is None:
        return tensors
    return {k: (v.astype(dtype.numpy) if Dtype.of(v.dtype).is_floating and
                Dtype.of(v.dtype) != dtype else v) for k, v in tensors.items()}


class HostLLM(LLMFront):
    """Text generation from a local checkpoint directory on ``framework``'s backend
    (see the module docstring), with ``atb_torch.LLM``'s serving arguments:
    ``dtype`` ``"fp32"``, ``"bf16"``, ``"fp16"`` (default: the checkpoint's);
    ``enable_prefix_caching``, ``enable_speculative`` (prompt-lookup drafts of
    ``num_speculative_tokens``); ``max_batch_size`` running sequences,
    ``max_prefill_tokens`` per prefill step, the KV cache as ``num_blocks`` blocks of
    ``block_size`` tokens (default: room for ``max_batch_size`` full-length sequences
    within ``kv_cache_memory`` bytes); ``max_model_len`` tokens per request (default:
    the config's ``max_position_embeddings``, at most 2048)."""

    framework = "numpy"
    who = "LLM"

    def __init__(self, model: str | os.PathLike, device: str = "cpu", dtype: Any = None,
                 enable_prefix_caching: bool = True, enable_speculative: bool = False, *,
                 tokenizer: Any = None, max_batch_size: int = 32, max_prefill_tokens: int = 4096,
                 block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory: int = 256 * 2**20, num_speculative_tokens: int = 4,
                 max_model_len: int | None = None) -> None:
        if device != "cpu":
            raise ParamsError(self.who, "device", "'cpu' (the C kernels' device)", repr(device))
        if dtype is not None and str(dtype).lower() not in _DTYPES:
            raise ParamsError(self.who, "dtype", sorted(_DTYPES), repr(dtype))
        for name, v in (("max_batch_size", max_batch_size), ("block_size", block_size),
                        ("max_prefill_tokens", max_prefill_tokens),
                        ("num_speculative_tokens", num_speculative_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ParamsError(self.who, name, "an int >= 1", repr(v))
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
        self.op = GraphOp(decoder_layers(spec, weights, last_token=True), name=spec.arch)
        del tensors, weights
        mpe = getattr(self.config, "max_position_embeddings", None) or 2048
        self.max_model_len = int(max_model_len or min(mpe, 2048))
        if num_blocks is None:
            per_block = 2 * spec.num_layers * block_size * spec.kv_size * self.dtype.itemsize
            want = -(-max_batch_size * self.max_model_len // block_size)
            num_blocks = max(1, min(want, kv_cache_memory // per_block))
        self.cache = PagedKVCache(spec.num_layers, num_blocks, block_size, spec.num_kv_heads,
                                  spec.head_dim, dtype=self.dtype,
                                  enable_prefix_caching=enable_prefix_caching)
        self.model = PagedDecoder(self.op, self.cache, self.framework, self.vocab_size)
        self.enable_speculative = enable_speculative
        self.engine = Engine(self.model, self.cache, max_batch_size, max_prefill_tokens,
                             self.max_model_len,
                             SpecConfig(num_speculative_tokens) if enable_speculative else None)
        self.eos_ids = eos_token_ids(d, self.config)
        self.last_stats = GenerationStats()

    def _drain(self, reqs: list[Request]) -> Iterator[TokenEvent]:
        """Step the engine until ``reqs`` finish, yielding their events; stopping
        early (or an error) aborts the unfinished ones, freeing their blocks."""
        stats, engine = reqs[0].stats, self.engine
        mine = {id(r) for r in reqs}
        t0 = time.perf_counter()
        engine.add(reqs)
        try:
            while engine.has_work and any(r.finish_reason is None for r in reqs):
                for r, ev in engine.step():
                    stats.elapsed_s = time.perf_counter() - t0
                    if id(r) in mine:  # an unfinished other stream's events stay its own
                        yield ev
        finally:
            for r in reqs:
                if r.finish_reason is None:
                    engine.abort(r)
            stats.elapsed_s = time.perf_counter() - t0

    def close(self) -> None:
        """Free the KV cache and the plans now."""
        self.op.destroy()
        self.cache.destroy()

    def __repr__(self) -> str:
        s = self.spec
        return (f"{type(self).__module__.split('.')[0]}.LLM({self.path}, {s.num_layers} layers, "
                f"{self.dtype.name}, {self.framework}, cache={self.cache})")
