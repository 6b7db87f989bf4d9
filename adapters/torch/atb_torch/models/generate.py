"""atb's own decoding loop behind a compiled model's ``generate``.

Hugging Face's ``generate`` prepares everything (generation config, the logits
processors, the stopping criteria, batch expansion for ``num_return_sequences``)
and then calls ``_sample`` for greedy and sampled decoding; the compiled model's
``_sample`` runs :func:`atb_sample` instead of Hugging Face's loop: the prompt
through the core engine's prefill, then one decode step of its bound plan per token, with Hugging
Face's own processors and criteria applied to each step's fp32 logits in Hugging
Face's order — so every processor ``generate`` builds (min/max length, temperature,
top-k/top-p/min-p, typical, repetition penalty, no-repeat n-grams, bad words,
forced/suppressed tokens, stop strings, EOS handling, user processors) keeps the
decode plan's speed, and the tokens are Hugging Face's. Sampling draws what
``torch.multinomial(softmax(scores), 1)`` draws, once per step, as Hugging Face's
loop does, so a seeded run gives Hugging Face's tokens. The costly pieces on a large
vocabulary (temperature/top-k/top-p with the draw, penalties, min length) run as
bit-identical faster equivalents (:mod:`.sample_step`, :mod:`.processors`,
:mod:`.sampler`), and the usual stopping criteria (max length, EOS) are answered
from Python ints (:func:`_stopper`).

What it cannot run returns None (logged once per reason) and Hugging Face's loop
runs over the compiled ``forward``: dict outputs (``return_dict_in_generate``),
attention weights or hidden states, ``inputs_embeds`` or ``token_type_ids`` prompts,
a caller's own cache, ``synced_gpus``, opt_level < 2. Beam search and assisted
decoding are Hugging Face's loops by construction.

``runner.stats["loop_tokens"]`` counts the steps atb's loop ran.

With ``enable_prefix_caching`` a batch-1 call reuses the KV of the longest prefix it
shares with the previous call's tokens (counted in ``runner.stats["prefix_hits"]``).
With ``enable_speculative`` greedy batch-1 calls use Hugging Face's prompt-lookup
decoding (same tokens, fewer forward passes).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import numpy as np
import torch

from .hf_cache import AtbCache
from .hf_compat import CACHE_NAMES, cache_kwarg, log_once
from atbcore.backends.cpu_kernels.threads import parked_torch_threads
from atbcore.runtime.binding import POOL_ROWS_MAX

from .processors import thread_invariant
from .sample_step import token_picker

__all__ = ["atb_sample", "speculative_kwargs"]

# model_kwargs the loop reads or may ignore (generate passes them along)
_KNOWN = {"attention_mask", "position_ids", "use_cache", "cache_position", "logits_to_keep", "return_dict",
          "output_attentions", "output_hidden_states", "tokenizer", "assistant_tokenizer",
          *CACHE_NAMES}


def _unsupported(model: Any, gc: Any, synced_gpus: bool, model_kwargs: dict) -> str | None:
    """Why atb's loop cannot answer this call (None: it can)."""
    r = model.atb_runner
    if r.opt_level < 2 or r.lm_head is None:
        return f"opt_level {r.opt_level}" if r.opt_level < 2 else "a model without an LM head"
    if synced_gpus:
        return "synced_gpus"
    for name in ("return_dict_in_generate", "output_attentions", "output_hidden_states"):
        if getattr(gc, name, None):
            return name
    extra = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _KNOWN)
    if extra:
        return f"model argument {extra[0]!r}"
    cache = model_kwargs.get(cache_kwarg())
    if not isinstance(cache, AtbCache) or cache.kv is not None or cache.runner is not r:
        return "a cache passed by the caller" if cache is not None else "use_cache=False"
    return None


def atb_sample(model: Any, input_ids: torch.Tensor, logits_processor: Any,
               stopping_criteria: Any, gc: Any, synced_gpus: bool, streamer: Any,
               model_kwargs: dict) -> torch.Tensor | None:
    """The generated ids ``[B, S + n]`` (Hugging Face's ``_sample`` result without
    dict outputs), or None to let Hugging Face's loop run (see the module docstring)."""
    why = _unsupported(model, gc, synced_gpus, model_kwargs)
    if why is not None:
        log_once(f"generate: {why} -> Hugging Face's decoding loop over the compiled forward")
        return None
    mask = model_kwargs.get("attention_mask")
    if mask is not None and bool(mask.bool().all()):
        mask = None
    with torch.no_grad():
        return _loop(model, input_ids, mask, model_kwargs.get("position_ids"),
                     model_kwargs[cache_kwarg()], logits_processor, stopping_criteria, gc,
                     streamer)


def _prefix(model: Any, ids: torch.Tensor, mask: Any) -> tuple[Any, int]:
    """(cache, reused tokens) for a batch-1 prompt from the previous call's cache."""
    prev = model.__dict__.get("_atb_prefix")
    if not model.atb_options.get("enable_prefix_caching") or prev is None or ids.shape[0] != 1 \
            or mask is not None:
        return None, 0
    tokens, kv = prev
    n = min(tokens.shape[1], ids.shape[1] - 1)  # at least one new token computes logits
    same = (tokens[0, :n] == ids[0, :n]).long()
    common = int(same.cumprod(0).sum()) if n > 0 else 0
    if common == 0:
        return None, 0
    kv.crop(common)
    kv.key_mask = None
    return kv, common


def _loop(model: Any, ids: torch.Tensor, mask: Any, pos: Any, cache: AtbCache,
          logits_processor: Any, stopping_criteria: Any, gc: Any, streamer: Any) -> torch.Tensor:
    r = model.atb_runner
    ids = ids.to(r.device)
    mask = None if mask is None else mask.to(r.device)
    b, s = ids.shape
    kv, start = _prefix(model, ids, mask)
    if kv is None:
        kv = cache.storage(b, max(int(gc.max_length), s + 1))
    else:
        cache.kv = kv
        kv.reserve(max(int(gc.max_length), s + 1))
        r.stats["prefix_hits"] = r.stats.get("prefix_hits", 0) + start
    # positions as Hugging Face's generate makes them (when the caller gave none):
    # cumsum(mask) - 1, padding at 0; then one more per step
    if pos is not None:
        pos = pos.to(r.device).expand(b, s)
    elif mask is not None:
        m = mask.bool()
        pos = (m.long().cumsum(-1) - 1).masked_fill(~m, 0)
    else:
        pos = torch.arange(s, device=r.device)[None].expand(b, s)
    logits = r.prefill(ids[:, start:], kv, attention_mask=mask, position_ids=pos[:, start:])
    next_pos = pos[:, -1] + 1
    # Hugging Face's _sample, step for step (processors see fp32 logits and all ids so far)
    pick = token_picker(logits_processor, bool(gc.do_sample))
    pad = gc._pad_token_tensor
    has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    unfinished = torch.ones(b, dtype=torch.bool, device=r.device)
    # the steps run with torch's pool parked, as a decode plan of few rows does inside:
    # torch's OpenMP workers, woken by a processor between two decode steps, would spin
    # on the cores the C kernels' pool needs, and a few rows of processors gain nothing
    # from them. Only where every processor gives the same bits at any thread count.
    parked = parked_torch_threads() if r.device.type == "cpu" and b <= POOL_ROWS_MAX and \
        thread_invariant(logits_processor) else contextlib.nullcontext()
    with parked:
        ids = _steps(r, kv, ids, logits, next_pos, pick, stopping_criteria, pad, has_eos,
                     unfinished, streamer)
    if streamer is not None:
        streamer.end()
    if model.atb_options.get("enable_prefix_caching") and b == 1 and mask is None:
        model.__dict__["_atb_prefix"] = (ids[:, :kv.length].clone(), kv)
    return ids


def _stopper(criteria: Any) -> Any:
    """``stop(ids, tok) -> rows done [B] or None (none)`` for a criteria list of only
    Hugging Face's max-length and EOS criteria (their answers, from Python ints: each
    criterion is several small tensor ops a step, and a decode step leaves them cold);
    None for any other list (the list itself runs)."""
    from transformers.generation import stopping_criteria as sc

    lengths, eos = [], set()
    for c in criteria:
        if type(c) is sc.MaxLengthCriteria:
            lengths.append(c)
        elif type(c) is sc.EosTokenCriteria:
            eos.update(torch.as_tensor(c.eos_token_id).reshape(-1).tolist())
        else:
            return None

    def stop(ids: torch.Tensor, tok: torch.Tensor) -> torch.Tensor | None:
        n = ids.shape[-1]
        for c in lengths:
            if n >= c.max_length:
                return torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device)
            mpe = getattr(c, "max_position_embeddings", None)
            if mpe is not None and n > mpe:
                c(ids, None)  # its once-only warning
        rows = [t in eos for t in tok.tolist()] if eos else []
        return torch.tensor(rows, device=ids.device) if any(rows) else None

    return stop


def _steps(r: Any, kv: Any, ids: torch.Tensor, logits: torch.Tensor, next_pos: torch.Tensor,
           pick: Any, stopping_criteria: Any, pad: Any, has_eos: bool,
           unfinished: torch.Tensor, streamer: Any) -> torch.Tensor:
    """The decoding steps after the prefill: ids with the new tokens."""
    stop = _stopper(stopping_criteria)
    every_row_on = stop is not None  # known without a tensor op only with the fast criteria
    private = not getattr(pick, "reads_only", False)
    # the positions as host ints (what decode reads), one more per step without a torch op
    pos = next_pos.detach().reshape(-1).cpu().numpy().astype(np.int64)
    # the ids so far live in one buffer that grows by doubling: a step writes its column
    # (a torch.cat per step copied every id again)
    b, n = ids.shape
    buf = torch.empty(b, max(2 * n, n + 64), dtype=ids.dtype, device=ids.device)
    buf[:, :n] = ids
    while True:
        # a private fp32 copy where the processors may write into it
        tok = pick(ids, logits.to(dtype=torch.float32, copy=True) if private else logits)  # [B]
        if has_eos and not every_row_on:
            tok = torch.where(unfinished, tok, pad.to(tok.device))
        if n == buf.shape[1]:
            buf = torch.cat([buf, torch.empty_like(buf)], dim=-1)
        buf[:, n] = tok
        n += 1
        ids = buf[:, :n]
        r.stats["loop_tokens"] = r.stats.get("loop_tokens", 0) + 1
        if streamer is not None:
            streamer.put(tok.cpu())
        done = stopping_criteria(ids, None) if stop is None else stop(ids, tok)
        if done is not None:
            unfinished &= ~done
            every_row_on = False
            if not bool(unfinished.any()):
                break
        logits = r.decode(tok, kv, positions=pos)
        pos = pos + 1
    return ids.clone()  # its own contiguous storage, not a view of the buffer


def _config(model: Any, generation_config: Any, kwargs: dict) -> tuple[Any, dict]:
    gc = copy.deepcopy(generation_config if generation_config is not None
                       else model.generation_config)
    rest = gc.update(**kwargs)
    return gc, rest


def speculative_kwargs(model: Any, inputs: Any, generation_config: Any, kwargs: dict) -> dict:
    """With ``enable_speculative``: add Hugging Face's prompt-lookup decoding to
    greedy batch-1 calls that did not choose an assistant themselves."""
    if not model.atb_options.get("enable_speculative"):
        return kwargs
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
        return kwargs
    if any(k in kwargs for k in ("prompt_lookup_num_tokens", "assistant_model")):
        return kwargs
    try:
        gc, _ = _config(model, generation_config, dict(kwargs))
    except (TypeError, ValueError):
        return kwargs
    if gc.do_sample or (gc.num_beams or 1) > 1:
        return kwargs
    return {**kwargs, "prompt_lookup_num_tokens": int(model.atb_options.get(
        "speculative_tokens", 10))}
