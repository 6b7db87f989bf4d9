"""torch's CPU generator stepped by the C kernels: :func:`mt19937_uniforms`.

torch's CPU generator is an MT19937 whose state ``get_state()`` exposes (624 words
and the count of words left in the current block); ``uniform_()`` on a float64
tensor takes two words per draw. :func:`mt19937_uniforms` makes ``n`` such draws in
C (``csrc/mt19937.c``), returns the ones asked for, and writes the advanced state
back: the generator ends where ``torch.empty(n, dtype=torch.float64).uniform_()``
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

__all__ = ["mt19937_uniforms"]

_ARGS = struct.Struct("<6q")
_STATE_BYTES = 5056   # CPUGeneratorImplState
_N = 624              # words per MT19937 block
# byte offsets in the state: int32 words left, uint64 next index, uint64 words[624]
_LEFT, _NEXT, _WORDS = 8, 16, 24
_CALL: list[Callable[[bytes], int]] = []


def mt19937_uniforms(n: int, want: np.ndarray, generator: Any = None) -> np.ndarray | None:
    """The float64 uniforms ``uniform_()`` would draw at the ascending indices ``want``
    of its next ``n`` draws from ``generator`` (default: torch's), moving the
    generator past all ``n``; None (generator untouched) when the C kernels or the
    state layout are not there."""
    if unavailable_reason() is not None:
        return None
    gen = torch.default_generator if generator is None else generator
    state = gen.get_state()
    raw = state.numpy()
    if raw.size != _STATE_BYTES:
        return None
    left = int(raw[_LEFT:_LEFT + 4].view(np.int32)[0])
    if not 1 <= left <= _N:
        return None
    words = raw[_WORDS:_WORDS + 8 * _N].view(np.uint64)
    if int(words.max()) >= 1 << 32:
        return None
    key = words.astype(np.uint32)
    pos = np.array([_N + 1 - left], dtype=np.int64)
    want = np.ascontiguousarray(want, dtype=np.int64)
    out = np.empty(len(want))
    if not _CALL:
        _CALL.append(entry("mt19937_uniforms"))
    status = _CALL[0](_ARGS.pack(key.ctypes.data, pos.ctypes.data, int(n), want.ctypes.data,
                                 len(want), out.ctypes.data))
    if status != 0:
        return None
    words[:] = key
    raw[_LEFT:_LEFT + 4].view(np.int32)[0] = _N + 1 - int(pos[0])
    raw[_NEXT:_NEXT + 8].view(np.uint64)[0] = int(pos[0])
    gen.set_state(state)
    return out
