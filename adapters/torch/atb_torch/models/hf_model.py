"""The compiled Hugging Face model: a subclass of the user's model class whose
``forward`` runs the core engine (:class:`.core_runner.CoreRunner`, encoders
:class:`.lower_encoder.CoreEncoder`).

``wrap_hf(model, runner)`` returns a new instance of a subclass of the model's class
(same name and module, so ``save_pretrained`` writes the original architecture and
pipelines accept it; ``isinstance(m, AtbCausalLMMixin)`` tells them apart) that shares
the original's submodules, config and generation config (the original model is left
as it was), so everything ``generate`` and user code read from the model keeps
working; only ``forward``, ``generate`` and ``_sample`` change.

* Decoders: ``forward(input_ids, attention_mask, position_ids, cache | past_key_values,
  inputs_embeds, labels, use_cache, logits_to_keep, ...)`` (the cache under either
  name: transformers 5.24 renamed it) returns ``CausalLMOutputWithPast``
  (``BaseModelOutputWithPast`` for base models) with an :class:`.hf_cache.AtbCache` as
  the cache; single-token steps over a cache run the decode plan at opt >= 2.
  ``generate`` sizes the cache to ``max_length``; its greedy and sampled decoding run
  atb's loop (:mod:`.generate`).
* Encoders: ``forward(input_ids, attention_mask, token_type_ids, position_ids,
  inputs_embeds)`` returns ``BaseModelOutputWithPoolingAndCrossAttentions``.

``output_attentions`` / ``output_hidden_states`` run the model's own forward over the
shared weights (logged once: atb materialises neither); other keyword arguments atb
does not implement raise :class:`~atbcore.errors.CapabilityError`.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch

from atbcore.errors import CapabilityError, ParamsError

from .hf_cache import AtbCache, to_atb_cache
from .hf_compat import CACHE_NAMES, cache_kwarg, log_once, output_with_cache

__all__ = ["wrap_hf", "AtbCausalLMMixin", "AtbEncoderMixin"]

# keyword arguments forward accepts and ignores (generate and pipelines pass them;
# Hugging Face's own models ignore them too)
_IGNORED = {"return_dict", "cache_position", "num_items_in_batch", "tokenizer",
            "assistant_tokenizer"}


def _refuse(kwargs: dict) -> None:
    bad = sorted(k for k, v in kwargs.items() if v is not None and k not in _IGNORED)
    if bad:
        raise CapabilityError("compile", f"forward argument {bad[0]!r}", "an argument the "
                              "compiled model implements", bad)


def _one_cache(cache: Any, past_key_values: Any) -> Any:
    """The cache passed under either name (``cache`` from transformers 5.24 on)."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ParamsError("compile", "cache", "one of cache= and past_key_values=", "both")
    return cache if cache is not None else past_key_values


def _tuple(out: Any, return_dict: Any) -> Any:
    return out.to_tuple() if return_dict is False else out


def _hf_cache(cache: Any, config: Any) -> Any:
    """A Hugging Face ``DynamicCache`` holding ``cache``'s tokens (an AtbCache cannot
    be written by the model's own layers), or ``cache`` itself."""
    if not isinstance(cache, AtbCache):
        return cache
    from transformers.cache_utils import DynamicCache

    out = DynamicCache(config=config)
    if cache.get_seq_length():
        for i, (k, v) in enumerate(cache):
            out.update(k.clone(), v.clone(), i)                          # [B, Hkv, S, D]
    return out


class AtbCausalLMMixin:
    """Decoder ``forward`` / ``generate`` of a compiled model (see module docstring)."""

    atb_runner: Any
    atb_options: dict

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: Any = None,
                position_ids: Any = None, past_key_values: Any = None, inputs_embeds: Any = None,
                labels: Any = None, use_cache: bool | None = None,
                logits_to_keep: int | torch.Tensor = 0, token_type_ids: Any = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, cache: Any = None, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

        past_key_values = _one_cache(cache, past_key_values)
        if output_attentions or output_hidden_states:
            return self._hf_forward(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                use_cache=use_cache, logits_to_keep=logits_to_keep, token_type_ids=token_type_ids,
                output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                return_dict=return_dict, **kwargs)
        _refuse(kwargs)
        r = self.atb_runner
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if r.spec.arch != "gpt2":
            token_type_ids = None  # only GPT-2 embeds them; the other families ignore them too
        why = getattr(r, "why_not_forward", None)
        why = why(attention_mask, inputs_embeds, token_type_ids) if why is not None else ""
        if why:
            log_once(f"compile: {why} -> the model's own forward (the core plan runs token ids "
                     "with a 2-D mask)")
            return self._hf_forward(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                use_cache=use_cache, logits_to_keep=logits_to_keep, token_type_ids=token_type_ids,
                return_dict=return_dict, **kwargs)
        src = input_ids if input_ids is not None else inputs_embeds
        b, t = src.shape[0], src.shape[1]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        cache = None
        if past_key_values is not None or use_cache:
            cap = 0 if past_key_values is not None else ((t + 255) // 256) * 256
            cache = (AtbCache(r, cap) if past_key_values is None
                     else to_atb_cache(past_key_values, r, t))
        kv = cache.storage(b, cache.get_seq_length() + t) if cache is not None else None
        logits = None
        mask = attention_mask
        if (kv is not None and t == 1 and r.opt_level >= 2 and inputs_embeds is None
                and token_type_ids is None and (mask is None or mask.dim() == 2)
                and r.lm_head is not None and isinstance(logits_to_keep, int)):
            pos = (position_ids.reshape(b) if position_ids is not None else
                   torch.full((b,), kv.length, dtype=torch.long, device=r.device))
            logits = r.decode(input_ids.reshape(b), kv, positions=pos,
                              attention_mask=mask).clone()[:, None]
        else:
            logits = r.forward(input_ids, kv, position_ids=position_ids, attention_mask=mask,
                               inputs_embeds=inputs_embeds, token_type_ids=token_type_ids,
                               logits_to_keep=logits_to_keep)
        pkv = cache if use_cache else None
        if r.lm_head is None:
            return _tuple(output_with_cache(BaseModelOutputWithPast, pkv,
                                            last_hidden_state=logits), return_dict)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels,
                                      vocab_size=self.config.vocab_size)
        return _tuple(output_with_cache(CausalLMOutputWithPast, pkv, loss=loss, logits=logits),
                      return_dict)

    def _hf_forward(self, past_key_values: Any = None, **kwargs: Any) -> Any:
        """The model's own (uncompiled) forward over the shared weights: what atb has
        no fast path for (attention weights, every layer's hidden states)."""
        what = [k for k in ("output_attentions", "output_hidden_states") if kwargs.get(k)]
        log_once(f"compile: {' and '.join(what)} -> the model's own forward (atb computes "
                 "neither attention weights nor per-layer hidden states)")
        if past_key_values is not None:
            kwargs[cache_kwarg()] = _hf_cache(past_key_values, self.config)
        return super().forward(**kwargs)

    def _prepare_cache_for_generation(self, generation_config: Any, model_kwargs: dict,
                                      generation_mode: Any, batch_size: int,
                                      max_cache_length: int) -> Any:
        gc = generation_config
        if (any(model_kwargs.get(n) is not None for n in CACHE_NAMES) or gc.use_cache is False
                or gc.cache_implementation not in (None, "dynamic", "static")
                or gc.output_attentions or gc.output_hidden_states):
            # a cache the model's own forward can write (the last two run it, see forward)
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        # allocated on the first forward (the batch after beam/sample expansion), sized
        # for the whole generation so no step reallocates
        model_kwargs[cache_kwarg()] = AtbCache(self.atb_runner, max_cache_length + 1)
        return None

    def _sample(self, input_ids: torch.Tensor, logits_processor: Any, stopping_criteria: Any,
                generation_config: Any, synced_gpus: bool = False, streamer: Any = None,
                **model_kwargs: Any) -> Any:
        """Greedy and sampled decoding (Hugging Face's ``_sample``, which ``generate``
        calls with its logits processors and stopping criteria ready): atb's own loop
        over the decode plan where it can (see :mod:`.generate`), else Hugging Face's."""
        from .generate import atb_sample

        out = atb_sample(self, input_ids, logits_processor, stopping_criteria,
                         generation_config, synced_gpus, streamer, model_kwargs)
        if out is not None:
            return out
        return super()._sample(input_ids, logits_processor, stopping_criteria, generation_config,
                               synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)

    def generate(self, inputs: torch.Tensor | None = None, generation_config: Any = None,
                 **kwargs: Any) -> Any:
        """Hugging Face ``generate``. Greedy and sampled decoding (with the common
        logits processors and stopping criteria) run atb's own loop over the decode
        plan, with the same tokens; beams and assisted decoding run Hugging Face's
        loop over the compiled forward (see :mod:`.generate`)."""
        from .generate import speculative_kwargs

        kwargs = speculative_kwargs(self, inputs, generation_config, kwargs)
        return super().generate(inputs, generation_config=generation_config, **kwargs)


class AtbEncoderMixin:
    """Encoder ``forward`` of a compiled model (BERT)."""

    atb_runner: Any
    atb_options: dict

    def forward(self, input_ids: Any = None, attention_mask: Any = None, token_type_ids: Any = None,
                position_ids: Any = None, inputs_embeds: Any = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, use_cache: Any = None, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

        if output_attentions or output_hidden_states:
            what = [k for k, v in (("output_attentions", output_attentions),
                                   ("output_hidden_states", output_hidden_states)) if v]
            log_once(f"compile: {' and '.join(what)} -> the model's own forward")
            return super().forward(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                position_ids=position_ids, inputs_embeds=inputs_embeds,
                output_attentions=output_attentions, output_hidden_states=output_hidden_states,
                return_dict=return_dict, **kwargs)
        _refuse(kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        last, pooled = self.atb_runner.encode(input_ids, attention_mask, token_type_ids,
                                              position_ids, inputs_embeds)
        return _tuple(BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=last, pooler_output=pooled), return_dict)


_CLASSES: dict[tuple[type, type], type] = {}


def wrap_hf(model: Any, runner: Any, options: dict | None = None) -> Any:
    """A compiled copy of ``model`` (see the module docstring)."""
    mixin = AtbEncoderMixin if runner.spec.kind == "encoder" else AtbCausalLMMixin
    base = type(model)
    cls = _CLASSES.get((mixin, base))
    if cls is None:
        # the base's name and module: Hugging Face keys on them (the ``architectures``
        # save_pretrained writes, the pipelines' supported-model lists, the attention
        # and experts implementation checks, which read the class's module file)
        cls = type(base.__name__, (mixin, base), {"__module__": base.__module__,
                                                  "__qualname__": base.__qualname__,
                                                  "__doc__": base.__doc__})
        _CLASSES[(mixin, base)] = cls
    new = object.__new__(cls)
    new.__dict__.update(model.__dict__)
    # own containers, so edits to one model's module tree do not reach the other
    for name in ("_modules", "_parameters", "_buffers"):
        new.__dict__[name] = OrderedDict(model.__dict__[name])
    new.__dict__["atb_runner"] = runner
    new.__dict__["atb_options"] = dict(options or {})
    new.__dict__["generation_config"] = copy.deepcopy(getattr(model, "generation_config", None))
    return new
