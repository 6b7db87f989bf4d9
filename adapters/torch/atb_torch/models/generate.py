"""atb's own greedy loop behind a compiled model's ``generate``.

``fast_greedy`` answers only calls whose result it reproduces exactly: greedy
(``do_sample`` False, one beam, one sequence), ``max_new_tokens`` given, input ids
(with an ``attention_mask``, or no padding token configured), and no logits
processors, stopping criteria, streamers, assistants or dict outputs. Tokens follow
Hugging Face's rules: positions ``cumsum(mask) - 1`` then +1 per step, ``argmax`` of
the last logits, rows that produced an EOS token continue with ``pad_token_id``, the
loop ends when every row has finished. Anything else returns None and Hugging
Face's ``generate`` runs (still through the compiled ``forward``).

With ``enable_prefix_caching`` a batch-1 call reuses the KV of the longest prefix it
shares with the previous call's tokens (counted in ``runner.stats["prefix_hits"]``).
With ``enable_speculative`` greedy batch-1 calls that reach Hugging Face's
``generate`` use its prompt-lookup decoding (same tokens, fewer forward passes).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["fast_greedy", "speculative_kwargs"]

# generation settings the loop implements (any other non-None setting falls back)
_ALLOWED = {"max_new_tokens", "max_length", "do_sample", "num_beams", "use_cache",
            "pad_token_id", "bos_token_id", "eos_token_id", "temperature", "top_k", "top_p",
            "num_return_sequences", "return_dict_in_generate", "output_attentions",
            "output_hidden_states", "output_scores", "output_logits", "cache_implementation",
            "min_length", "min_new_tokens", "transformers_version", "_from_model_config",
            "disable_compile", "max_cache_len", "remove_invalid_values", "length_penalty",
            "early_stopping", "low_memory"}
_MUST = {"do_sample": (None, False), "num_beams": (None, 1), "use_cache": (None, True),
         "num_return_sequences": (None, 1), "return_dict_in_generate": (None, False),
         "output_attentions": (None, False), "output_hidden_states": (None, False),
         "output_scores": (None, False), "output_logits": (None, False),
         "cache_implementation": (None, "dynamic", "static"), "min_length": (None, 0),
         "min_new_tokens": (None, 0), "remove_invalid_values": (None, False)}


def _config(model: Any, generation_config: Any, kwargs: dict) -> tuple[Any, dict]:
    gc = copy.deepcopy(generation_config if generation_config is not None
                       else model.generation_config)
    rest = gc.update(**kwargs)
    return gc, rest


def _plain_greedy(gc: Any) -> bool:
    d = gc.to_dict()
    for k, v in d.items():
        if v is None:
            continue
        if k not in _ALLOWED or (k in _MUST and v not in _MUST[k]):
            return False
    return True


def _ids(tok: Any) -> list[int]:
    if tok is None:
        return []
    if isinstance(tok, torch.Tensor):
        return [int(x) for x in tok.reshape(-1).tolist()]
    return [int(x) for x in (tok if isinstance(tok, (list, tuple)) else [tok])]


def fast_greedy(model: Any, inputs: Any, generation_config: Any, kwargs: dict) -> Any:
    """The generated ids ``[B, S + n]``, or None to let Hugging Face run."""
    r = model.atb_runner
    if r.opt_level < 2 or r.spec.kind != "decoder" or r.lm_head is None:
        return None
    kwargs = dict(kwargs)
    ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    mask = kwargs.pop("attention_mask", None)
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.long, torch.int):
        return None
    try:
        gc, rest = _config(model, generation_config, kwargs)
    except (TypeError, ValueError):
        return None
    if rest or not _plain_greedy(gc) or not gc.max_new_tokens:
        return None
    pad_ids, eos = _ids(gc.pad_token_id), _ids(gc.eos_token_id)
    if eos and not pad_ids:
        pad_ids = eos[:1]  # what Hugging Face does (with a warning)
    if mask is None and pad_ids and pad_ids[0] not in eos and bool((ids == pad_ids[0]).any()):
        mask = (ids != pad_ids[0]).long()  # Hugging Face infers the mask from pad tokens
    if mask is not None and bool(mask.bool().all()):
        mask = None
    with torch.no_grad():
        return _loop(model, ids.to(r.device), None if mask is None else mask.to(r.device),
                     int(gc.max_new_tokens), eos, pad_ids[0] if pad_ids else 0)


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


def _loop(model: Any, ids: torch.Tensor, mask: Any, max_new: int, eos: list[int],
          pad: int) -> torch.Tensor:
    r = model.atb_runner
    b, s = ids.shape
    kv, start = _prefix(model, ids, mask)
    if kv is None:
        kv = r.new_cache(b, s + max_new)
    else:
        kv.reserve(s + max_new)
        r.stats["prefix_hits"] = r.stats.get("prefix_hits", 0) + start
    if mask is not None:
        m = mask.bool()
        pos = (m.long().cumsum(-1) - 1).masked_fill(~m, 0)
    else:
        pos = torch.arange(s, device=r.device)[None].expand(b, s)
    logits = r.prefill(ids[:, start:], kv, attention_mask=mask,
                       position_ids=pos[:, start:] if start or mask is None else None)
    next_pos = pos[:, -1] + 1
    out = [ids]
    eos_t = torch.tensor(eos, device=r.device) if eos else None
    unfinished = torch.ones(b, dtype=torch.bool, device=r.device)
    for i in range(max_new):
        tok = logits.argmax(dim=-1)                                      # [B]
        if eos_t is not None:
            tok = torch.where(unfinished, tok, torch.full_like(tok, pad))
            unfinished &= ~torch.isin(tok, eos_t)
        out.append(tok[:, None])
        if i == max_new - 1 or (eos_t is not None and not bool(unfinished.any())):
            break
        logits = r.decode(tok, kv, positions=next_pos)
        next_pos = next_pos + 1
    result = torch.cat(out, dim=1)
    if model.atb_options.get("enable_prefix_caching") and b == 1 and mask is None:
        model.__dict__["_atb_prefix"] = (result[:, :kv.length].clone(), kv)
    return result


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
