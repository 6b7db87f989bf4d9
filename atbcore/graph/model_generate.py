"""``generate`` for models built from atb GraphOps, in any front-end.

A compiled MindSpore Cell or Paddle Layer built from atb GraphOps (the seed's
``AcceleratedLLaMA`` in that framework) generates with :func:`generate_ids`: the
model's state (a ``kv_cache`` attribute: an ``atb.KVCache``, or the dict/None a
GraphOp returns) is reset (:func:`reset_model_cache`), the prompt runs once, then one
token per step when the model keeps a cache, else the whole sequence each step.
Tokens are chosen on the host: greedy is ``argmax`` of the fp32 logits (the first
maximum, as ``argmax`` everywhere); ``do_sample`` draws with atb's seeded
``TopkToppSampling`` (NumPy reference kernel, the same draw on every backend). The
framework only runs the model: ``run(ids) -> logits [B, S, V]`` in its own tensors.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import CapabilityError, ParamsError
from ..tensor import convert, to_numpy

__all__ = ["generate_ids", "reset_model_cache", "check_compile"]


def check_compile(mode: Any, opt_level: Any) -> None:
    """``compile``'s shared arguments: inference mode, opt_level 0..3."""
    if mode != "infer":
        raise CapabilityError("compile", "mode", "'infer' (compiled models are inference-only)",
                              repr(mode))
    if isinstance(opt_level, bool) or opt_level not in (0, 1, 2, 3):
        raise ParamsError("compile", "opt_level", "0, 1, 2 or 3", repr(opt_level))


def reset_model_cache(model: Any) -> bool:
    """Empty the model's ``kv_cache`` state; False when it keeps none (each step then
    recomputes the whole sequence)."""
    if not hasattr(model, "kv_cache"):
        return False
    kv = model.kv_cache
    if kv is None or isinstance(kv, (dict, list)):
        model.kv_cache = None
    elif hasattr(kv, "reset"):
        kv.reset()
    else:
        raise CapabilityError("compile", "kv_cache state", "None, a dict, a list or a cache "
                              "with reset()", type(kv).__name__)
    return True


def _check(max_new_tokens: Any, top_k: Any, top_p: Any, temperature: Any) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
            or max_new_tokens < 0:
        raise ParamsError("generate", "max_new_tokens", "an int >= 0", repr(max_new_tokens))
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ParamsError("generate", "top_k", "an int >= 0 (0 = all)", repr(top_k))
    if not 0.0 < float(top_p) <= 1.0:
        raise ParamsError("generate", "top_p", "in (0, 1]", repr(top_p))
    if not float(temperature) > 0.0:
        raise ParamsError("generate", "temperature", "> 0", repr(temperature))


def generate_ids(model: Any, run: Callable[[Any], Any], input_ids: Any, framework: str,
                 max_new_tokens: int = 20, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 eos_token_id: int | None = None) -> np.ndarray:
    """The prompt ``[B, S]`` (any framework's int tensor or an array) with up to
    ``max_new_tokens`` new tokens, int64 ``[B, S + n]`` (see the module docstring).
    Rows that produced ``eos_token_id`` are padded with it; the loop stops when every
    row did."""
    _check(max_new_tokens, top_k, top_p, temperature)
    seq = np.asarray(to_numpy(input_ids))
    if seq.ndim != 2 or seq.shape[1] < 1 or not np.issubdtype(seq.dtype, np.integer):
        raise ParamsError("generate", "input_ids", "int token ids [B, S] with S >= 1",
                          f"{seq.dtype} {list(seq.shape)}")
    seq = seq.astype(np.int64)
    sampler = None
    if do_sample:
        from ..operation import Builder

        build = Builder(backend="numpy").build_operation
        sampler = lambda i: build("TopkToppSampling", {  # noqa: E731
            "top_k": int(top_k), "top_p": float(top_p), "temperature": float(temperature),
            "seed": None if seed is None else int(seed) + i})
    incremental = reset_model_cache(model)

    def logits_of(ids: np.ndarray) -> np.ndarray:
        out = np.asarray(to_numpy(run(convert(ids, framework))))
        return out[:, -1].astype(np.float32)

    logits = logits_of(seq)
    finished = np.zeros(seq.shape[0], dtype=bool)
    for i in range(max_new_tokens):
        if sampler is None:
            tok = logits.argmax(axis=-1).astype(np.int64)
        else:
            tok = np.asarray(sampler(i).execute([logits])[0]).astype(np.int64)
        if eos_token_id is not None:
            tok = np.where(finished, eos_token_id, tok)
            finished |= tok == eos_token_id
        seq = np.concatenate([seq, tok[:, None]], axis=1)
        if i == max_new_tokens - 1 or finished.all():
            break
        logits = logits_of(tok[:, None] if incremental else seq)
    return seq
