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
from typing import Any, Iterator

import numpy as np

from ..dtypes import Dtype
from ..errors import CapabilityError, ParamsError
from ..graph.graph_op import GraphOp
from ..memory import KVCache
from ..models.arch import resolve_architecture
from ..models.checkpoint import (check_checkpoint_dir, eos_token_ids, load_config, load_tensors,
                                 load_tokenizer, weights_from_tensors)
from ..models.decoder import decoder_layers, why_not_lowered
from .decode_loop import DecodeLoop
from .front import LLMFront
from .outputs import GenerationStats, TokenEvent
from .request import Request
from .row_feeder import RowFeeder

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

    def close(self) -> None:
        """Free the KV cache and the plans now."""
        self.op.destroy()
        self.cache.free()

    def __repr__(self) -> str:
        s = self.spec
        return (f"{type(self).__module__.split('.')[0]}.LLM({self.path}, {s.num_layers} layers, "
                f"{self.dtype.name}, {self.framework}, rows={self.cache.max_batch})")
