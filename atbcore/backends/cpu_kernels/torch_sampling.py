"""The decoding loop's sampling pieces in C: torch's CPU generator stepped by the C
kernels (:func:`mt19937_uniforms`), the sampling step that draws with it
(:func:`sample_top_k`) and the repetition penalty in place
(:func:`repetition_penalty_`). After a decode step has streamed the weights through
the caches each torch or NumPy call starts cold: one C call replaces several.

torch's CPU generator is an MT19937 whose state ``get_state()`` exposes (624 words
and the count of words left in the current block, read and written in C by
``csrc/mt19937.h``); ``uniform_()`` on a float64 tensor takes two words per draw.
:func:`mt19937_uniforms` makes ``n`` such draws in C (``csrc/mt19937.c``), returns
the ones asked for, and writes the advanced state back: the generator ends where ``torch.empty(n, dtype=torch.float64).uniform_()``
would leave it. The layout it reads is torch's, not a public contract, so callers
check the result against torch's own draws once (the sampler does) and the
function returns None on any state it does not recognise.
"""

from __future__ import annotations

import struct
from typing import Any, Callable

import numpy as np
import torch

from .bindings import entry, unavailable_reason

__all__ = ["mt19937_uniforms", "repetition_penalty_", "sample_top_k", "TOPK_MAX"]

_ARGS = struct.Struct("<5q")
_SAMPLE = struct.Struct("<9q2d")
_STATE_BYTES = 5056   # torch's CPUGeneratorImplState; csrc/mt19937.h reads its fields
TOPK_MAX = 1024       # sample.c's largest k
_CALLS: dict[str, Callable[[bytes], int]] = {}


def _call(name: str, args: bytes) -> int:
    if name not in _CALLS:
        _CALLS[name] = entry(name)
    return _CALLS[name](args)


def _state(generator: Any) -> tuple[Any, torch.Tensor] | None:
    if unavailable_reason() is not None:
        return None
    gen = torch.default_generator if generator is None else generator
    state = gen.get_state()
    return (gen, state) if state.numel() == _STATE_BYTES else None


def mt19937_uniforms(n: int, want: np.ndarray, generator: Any = None) -> np.ndarray | None:
    """The float64 uniforms ``uniform_()`` would draw at the ascending indices ``want``
    of its next ``n`` draws from ``generator`` (default: torch's), moving the
    generator past all ``n``; None (generator untouched) when the C kernels or the
    state layout are not there."""
    got = _state(generator)
    if got is None:
        return None
    gen, state = got
    want = np.ascontiguousarray(want, dtype=np.int64)
    out = np.empty(len(want))
    if _call("mt19937_uniforms", _ARGS.pack(state.data_ptr(), int(n), want.ctypes.data,
                                            len(want), out.ctypes.data)):
        return None
    gen.set_state(state)
    return out


def sample_top_k(scores: torch.Tensor, k: int, temperature: float, temp_mode: int,
                 limit: float, keep: int, generator: Any = None) -> torch.Tensor | None:
    """The tokens ``[B]`` that [temperature,] top-k ``k`` [, top-p], softmax and
    ``torch.multinomial`` give for CPU float32 ``scores`` ``[B, V]`` (last dim
    contiguous), moving ``generator`` as that draw does (``csrc/sample.c``); None
    (generator untouched) where it cannot be sure or cannot run.

    ``temp_mode``: 0 no temperature, 1 ``x / float32(t)`` (the caller checks that
    this is torch's division); ``limit``: top-p's float32 ``1 - top_p`` (< 0: no
    top-p); ``keep``: its ``min_tokens_to_keep``."""
    b, v = scores.shape
    if not 1 <= k < v or k > TOPK_MAX or scores.stride(-1) != 1:
        return None
    got = _state(generator)
    if got is None:
        return None
    gen, state = got
    out = torch.empty(b, dtype=torch.long)
    if _call("sample_top_k", _SAMPLE.pack(scores.data_ptr(), b, v, scores.stride(0), k,
                                          temp_mode, keep, state.data_ptr(), out.data_ptr(),
                                          float(temperature), float(limit))):
        return None
    gen.set_state(state)
    return out


_PENALTY = struct.Struct("<7qd")


def repetition_penalty_(scores: torch.Tensor, ids: torch.Tensor, penalty: float) -> bool:
    """Hugging Face's repetition penalty written into CPU float32 ``scores`` ``[B, V]``
    for the int64 token ids ``ids`` ``[B, n]`` (each seen id once: ``s * p`` where
    ``s < 0``, else ``s / p``, with ``p`` the float32 penalty, as torch computes
    them); False (scores untouched) when the C kernels are not there or an id is
    outside the vocabulary."""
    if unavailable_reason() is not None or scores.stride(-1) != 1 or ids.stride(-1) != 1 \
            or ids.dtype != torch.long:
        return False
    b, v = scores.shape
    return _call("repetition_penalty", _PENALTY.pack(
        scores.data_ptr(), b, v, scores.stride(0), ids.data_ptr(), ids.shape[1], ids.stride(0),
        float(penalty))) == 0
