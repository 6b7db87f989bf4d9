"""The compiled Hugging Face model: a subclass of the user's model class whose
``forward`` runs the :class:`.runner.ModelRunner`.

``wrap_hf(model, runner)`` returns a new instance of ``Atb<ModelClass>`` that shares
the original's submodules, config and generation config (the original model is left
as it was), so everything ``generate`` and user code read from the model keeps
working; only ``forward`` (and, for plain greedy decoding, ``generate``) change.

* Decoders: ``forward(input_ids, attention_mask, position_ids, past_key_values,
  inputs_embeds, labels, use_cache, logits_to_keep, ...)`` returns
  ``CausalLMOutputWithPast`` (``BaseModelOutputWithPast`` for base models) with an
  :class:`.hf_cache.AtbCache` as ``past_key_values``; single-token steps over a cache
  run the decode plan at opt >= 2. ``generate`` sizes the cache to ``max_length``.
* Encoders: ``forward(input_ids, attention_mask, token_type_ids, position_ids,
  inputs_embeds)`` returns ``BaseModelOutputWithPoolingAndCrossAttentions``.

Options atb does not implement (``output_attentions``, ``output_hidden_states``, other
non-None keyword arguments) raise :class:`~atbcore.errors.CapabilityError`.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

import torch

from atbcore.errors import CapabilityError

from .hf_cache import AtbCache, to_atb_cache

__all__ = ["wrap_hf", "AtbCausalLMMixin", "AtbEncoderMixin"]

# keyword arguments forward accepts and ignores (generate and pipelines pass them)
_IGNORED = {"return_dict", "cache_position", "num_items_in_batch"}


def _refuse(kwargs: dict, output_attentions: Any, output_hidden_states: Any) -> None:
    if output_attentions:
        raise CapabilityError("compile", "output_attentions", "False (compiled models do not "
                              "materialise attention weights)", True)
    if output_hidden_states:
        raise CapabilityError("compile", "output_hidden_states", "False", True)
    bad = sorted(k for k, v in kwargs.items() if v is not None and k not in _IGNORED)
    if bad:
        raise CapabilityError("compile", f"forward argument {bad[0]!r}", "an argument the "
                              "compiled model implements", bad)


def _tuple(out: Any, return_dict: Any) -> Any:
    return out.to_tuple() if return_dict is False else out


class AtbCausalLMMixin:
    """Decoder ``forward`` / ``generate`` of a compiled model (see module docstring)."""

    atb_runner: Any
    atb_options: dict

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: Any = None,
                position_ids: Any = None, past_key_values: Any = None, inputs_embeds: Any = None,
                labels: Any = None, use_cache: bool | None = None,
                logits_to_keep: int | torch.Tensor = 0, token_type_ids: Any = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, **kwargs: Any) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

        _refuse(kwargs, output_attentions, output_hidden_states)
        r = self.atb_runner
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if r.spec.arch != "gpt2":
            token_type_ids = None  # only GPT-2 embeds them; the other families ignore them too
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
            # Hugging Face semantics: no mask means every cached slot is attended
            kv.key_mask = None
            pos = (position_ids.reshape(b) if position_ids is not None else
                   torch.full((b,), kv.length, dtype=torch.long, device=r.device))
            logits = r.decode(input_ids.reshape(b), kv, positions=pos,
                              attention_mask=mask).clone()[:, None]
        else:
            if kv is not None:
                kv.key_mask = None
            logits = r.forward(input_ids, kv, position_ids=position_ids, attention_mask=mask,
                               inputs_embeds=inputs_embeds, token_type_ids=token_type_ids,
                               logits_to_keep=logits_to_keep)
        pkv = cache if use_cache else None
        if r.lm_head is None:
            return _tuple(BaseModelOutputWithPast(last_hidden_state=logits, past_key_values=pkv),
                          return_dict)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels,
                                      vocab_size=self.config.vocab_size)
        return _tuple(CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=pkv),
                      return_dict)

    def _prepare_cache_for_generation(self, generation_config: Any, model_kwargs: dict,
                                      generation_mode: Any, batch_size: int,
                                      max_cache_length: int) -> Any:
        if (model_kwargs.get("past_key_values") is not None
                or generation_config.use_cache is False
                or generation_config.cache_implementation not in (None, "dynamic", "static")):
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        # allocated on the first forward (the batch after beam/sample expansion), sized
        # for the whole generation so no step reallocates
        model_kwargs["past_key_values"] = AtbCache(self.atb_runner, max_cache_length + 1)
        return None

    def generate(self, inputs: torch.Tensor | None = None, generation_config: Any = None,
                 **kwargs: Any) -> Any:
        """Hugging Face ``generate``; plain greedy decoding of input ids (no logits
        processors, stopping criteria, streamers or dict outputs) runs atb's own
        loop over the decode plan, with the same tokens."""
        from .generate import fast_greedy, speculative_kwargs

        out = fast_greedy(self, inputs, generation_config, kwargs)
        if out is not None:
            return out
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

        _refuse(kwargs, output_attentions, output_hidden_states)
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
        cls = type(f"Atb{base.__name__}", (mixin, base), {"__module__": __name__,
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
