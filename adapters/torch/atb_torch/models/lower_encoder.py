"""A Hugging Face encoder (BERT; sentence-transformers' BERT models) as one core
GraphOp, with Hugging Face's encode semantics around it: what ``compile()`` runs an
encoder on (``compiled.atb_runner`` is a :class:`CoreEncoder`).

    from atb_torch.models.lower_encoder import lower_encoder
    enc = lower_encoder(hf_bert, dtype=torch.bfloat16)
    last, pooled = enc.encode(input_ids, attention_mask, token_type_ids)
    print(enc.explain())

:func:`lower_encoder` lowers the model with :func:`atbcore.models.encoder.encoder_layers`
(see there for the graph and its fusions). :class:`CoreEncoder` ``.encode`` takes a
padded batch ``[B, S]`` and any attention mask pattern (right, left, holes): it
keeps the real tokens only (packed row-major), runs the GraphOp over them
(attention within each row's own tokens) and scatters the rows back, so
``last_hidden`` ``[B, S, H]`` holds zeros at padding. Positions default to
``arange(S)`` per row and token types to 0, as Hugging Face's. ``pooled`` (models
with a pooler, else None) is ``tanh(dense(last[:, 0]))`` -- for a row whose
position 0 is padding that is the pooler of the zero vector, as the runner's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from atbcore.errors import CapabilityError, InputError
from atbcore.graph.graph_op import GraphOp
from atbcore.models.encoder import (ENCODER_FUSION, encoder_dim_names, encoder_layers,
                                    why_not_encoder)

from .arch import resolve_architecture
from .core_runner import _fusions

__all__ = ["lower_encoder", "CoreEncoder"]


def lower_encoder(model: Any, quantize: str | None = None, dtype: torch.dtype | None = None,
                  opt_level: int = 2, **graph_op_kwargs: Any) -> "CoreEncoder":
    """The Hugging Face encoder ``model`` (a ``BertModel``, a model with ``.bert``)
    as a :class:`CoreEncoder` computing in ``dtype`` (None: the model's);
    ``quantize``: None, "w8", "w8a8" or "w4" (see
    :func:`atbcore.models.encoder.encoder_layers`)."""
    arch = resolve_architecture(model.config)
    spec = arch.describe(model.config)
    return CoreEncoder(spec, arch.extract(model, spec), opt_level=opt_level, dtype=dtype,
                       quantize=quantize, **graph_op_kwargs)


def _dt(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


class CoreEncoder:
    """``encode(input_ids, attention_mask, token_type_ids, position_ids,
    inputs_embeds) -> (last_hidden [B, S, H], pooled [B, H] | None)`` on core
    GraphOps (one over token ids, one over given word vectors, built on first use).
    Built as compile() builds its runners: ``(spec, weights, opt_level=, dtype=,
    quantize=, device=)``; ``opt_level`` 0 runs every node as its own kernel, 1-3
    the standard fusions; ``dtype`` None: the weights'; ``quantize`` None, "w8",
    "w8a8" or "w4". One caller at a time per object (the GraphOps' plans are
    locked per run)."""

    def __init__(self, spec: Any, weights: Any, *, opt_level: int = 2,
                 dtype: torch.dtype | None = None, quantize: str | None = None,
                 device: Any = None, kv_cache_dtype: str | None = None,
                 **graph_op_kwargs: Any) -> None:
        why = why_not_encoder(spec)
        if why:
            raise CapabilityError("compile", why, "a BERT-style encoder", spec.arch)
        dtype = dtype or weights.embed.dtype
        self.spec, self.dtype, self.quantize = spec, dtype, quantize
        self.opt_level = int(opt_level)
        self.device = torch.device(device) if device is not None else weights.embed.device
        # the layers taken once (compile() counts them as they are taken)
        self._weights = dataclasses.replace(weights, layers=list(weights.layers))
        fusion = ENCODER_FUSION if self.opt_level > 0 else _fusions(0)
        self._kwargs = {"fusion_config": fusion, **graph_op_kwargs}
        self.n_pos = int(weights.pos_embed.shape[0])
        self.n_type = int(weights.type_embed.shape[0])
        self.vocab = int(weights.embed.shape[0])
        self.graph_op = self._graph_op(False)
        self._embeds_op: GraphOp | None = None
        self.pool_zero = None  # the pooler of a zero row: tanh(bias)
        if weights.pooler_b is not None:
            self.pool_zero = torch.tanh(weights.pooler_b.detach().float()).to(self.device, dtype)

    def _graph_op(self, embeds: bool) -> GraphOp:
        layers = encoder_layers(self.spec, self._weights, _dt(self.dtype), inputs_embeds=embeds,
                                quantize=self.quantize)
        return GraphOp(layers, name=f"{self.spec.arch}{'_embeds' if embeds else ''}",
                       dim_names=encoder_dim_names(embeds), **self._kwargs)

    def explain(self) -> str:
        """The GraphOp's report (nodes before/after fusion, kernels, layouts, arena)."""
        return self.graph_op.explain()

    @torch.no_grad()
    def encode(self, input_ids: torch.Tensor | None = None, attention_mask: Any = None,
               token_type_ids: Any = None, position_ids: Any = None,
               inputs_embeds: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """See the module docstring."""
        src = input_ids if input_ids is not None else inputs_embeds
        if src is None:
            raise InputError("encode", "inputs", "input_ids or inputs_embeds", "neither")
        b, s = int(src.shape[0]), int(src.shape[1])
        h, dev = self.spec.hidden_size, src.device
        pos = (torch.arange(s, device=dev)[None].expand(b, s) if position_ids is None
               else position_ids.expand(b, s))
        tt = (torch.zeros(b, s, dtype=torch.long, device=dev) if token_type_ids is None
              else token_type_ids.expand(b, s))
        _check_range(pos, self.n_pos, "position_ids")
        _check_range(tt, self.n_type, "token_type_ids")
        m = None if attention_mask is None else attention_mask.to(dev).bool()
        if m is not None and bool(m.all()):
            m = None
        if m is None:
            sel = None
            lens = torch.full((b,), s, dtype=torch.int32, device=dev)
        else:
            sel = m.reshape(-1).nonzero().squeeze(1)                     # real tokens, row-major
            lens = m.sum(dim=1, dtype=torch.int32)

        def take(t: torch.Tensor) -> torch.Tensor:                       # [B, S, ...] -> [T, ...]
            t = t.reshape(b * s, *t.shape[2:])
            return t if sel is None else t.index_select(0, sel)
        pt = take(tt.long() * self.n_pos + pos.long())
        if inputs_embeds is None:
            x = take(input_ids).long()
            _check_range(x, self.vocab, "input_ids")
            op = self.graph_op
        else:
            x = take(inputs_embeds).to(self.dtype).contiguous()
            if self._embeds_op is None:
                self._embeds_op = self._graph_op(True)
            op = self._embeds_op
        t = int(x.shape[0])
        starts = torch.cumsum(lens, 0, dtype=torch.int64) - lens         # first row of each sequence
        last = torch.zeros(b * s, h, dtype=self.dtype, device=dev)
        pooled = None
        if t:
            outs = op(x, pt, lens, starts.clamp(max=t - 1))
            hidden = outs[0] if isinstance(outs, tuple) else outs
            if sel is None:
                last = hidden
            else:
                last.index_copy_(0, sel, hidden)
            pooled = outs[1] if isinstance(outs, tuple) else None
        last = last.reshape(b, s, h)
        if self.pool_zero is not None:
            if pooled is None:
                pooled = self.pool_zero.expand(b, h).clone()
            elif m is not None and not bool(m[:, 0].all()):              # position 0 is padding
                pooled[~m[:, 0]] = self.pool_zero
        return last, pooled


def _check_range(t: torch.Tensor, n: int, what: str) -> None:
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= n):
        raise InputError("encode", f"{what} out of range", f"values in [0, {n})",
                         f"[{int(t.min())}, {int(t.max())}]")
