"""``ModelRunner``: the compiled model's compute, independent of Hugging Face's API.

Built by :func:`.compile.compile` (``compiled.atb_runner``) or directly::

    runner = ModelRunner.from_hf(hf_model, opt_level=2)        # or (spec, weights, ...)
    cache = runner.new_cache(batch=1, capacity=256)            # ContiguousKVCache
    logits = runner.prefill(input_ids, cache)                  # [B, V] of each row's last token
    for _ in range(n):
        ids = logits.argmax(-1)
        logits = runner.decode(ids, cache)                     # [B, V], one token per row

Entry points (all under ``torch.no_grad``; tensors on the runner's device):

* :meth:`forward` — any number of new tokens ``[B, T]`` over an optional contiguous
  cache, Hugging Face semantics for ``position_ids`` (default ``cache.length + arange``)
  and ``attention_mask`` (2-D ``[B, past + T]``, 1 = real token, any padding; or a
  4-D mask used as given); returns logits ``[B, T', V]`` (``logits_to_keep``) or,
  for base models, the final hidden states.
* :meth:`prefill` / :meth:`decode` — the serving pair: a (left-padded) prompt batch,
  then one token per row per step. ``decode`` runs the prebuilt :class:`.plan.DecodePlan`
  at opt >= 2 (bound kernel calls over preallocated buffers, cached per cache), the
  general path below that. The logits ``decode`` returns are the plan's buffer: read
  them before the next step (clone to keep).
* :meth:`forward_paged` — continuous batching over :class:`atbcore.memory.PagedKVCache`:
  packed new tokens of several sequences (``PagedBatch`` from ``prepare_prefill`` /
  ``prepare_decode``), ReshapeAndCache + PagedAttention per layer; returns the logits
  of each sequence's last new token ``[B, V]`` (or of every new token, for
  speculative verification).

Diagnostics: ``runner.stats`` (``plans_built``, ``plan_steps``, ``general_steps``,
``prefix_hits``), ``runner.weight_bytes`` (weights read per decode step: the GEMV
floor), ``plan.launches`` and :func:`atb_torch.llm.bench.measure.count_ops` (launches per step).

Threading: a runner and its caches serve one caller at a time (plans write shared
buffers); use one runner per thread.
"""

from __future__ import annotations

from typing import Any

import torch

from atbcore.errors import CapabilityError, InputError
from atbcore.memory import hugepages

from .arch import ModelSpec, ModelWeights, resolve_architecture
from .cache import ContiguousKVCache
from .kernels import ROWS_MAX
from .workspace import Workspace
from .layers import AttnCtx, DecoderBlock, Kern, Lin, Norm, Prep, detach, run_blocks
from .runner_paged import PagedCtx, PagedMixin

__all__ = ["ModelRunner", "PagedCtx"]


class ModelRunner(PagedMixin):
    """See the module docstring. ``opt_level`` 0..3, ``dtype`` (compute and weight
    dtype; None = the weights'), ``quantize`` None | "w8" | "w4" | "w8a8", ``device``;
    ``kv_cache_dtype`` None (the compute dtype) | "int8" (:mod:`.cache_int8`)."""

    def __init__(self, spec: ModelSpec, weights: ModelWeights, *, opt_level: int = 2,
                 dtype: torch.dtype | None = None, quantize: str | None = None,
                 device: Any = None, kv_cache_dtype: str | None = None) -> None:
        if spec.kind != "decoder":
            raise CapabilityError("compile", f"a {spec.kind} model on the hand-written runner",
                                  "a decoder (encoders run on lower_encoder.CoreEncoder)",
                                  spec.arch)
        dtype = dtype or weights.embed.dtype
        device = torch.device(device) if device is not None else weights.embed.device
        self.spec, self.dtype, self.device = spec, dtype, device
        self.opt_level, self.quantize = int(opt_level), quantize
        self.kv_cache_dtype = kv_cache_dtype
        arena = hugepages.Arena() if device.type == "cpu" and spec.kind == "decoder" else None
        self.prep = prep = Prep(self.opt_level, dtype, quantize, device,
                                rows_kernel=spec.kind == "decoder", arena=arena)
        self.embed_w = detach(weights.embed, dtype).to(device)
        self.pos_w = detach(weights.pos_embed, dtype)
        self.type_w = detach(weights.type_embed, dtype)
        self.k_embed = Kern("Embedding")
        self.blocks = [DecoderBlock(spec, lw, i, prep) for i, lw in enumerate(weights.layers)]
        self.final_norm = None if weights.final_norm is None else Norm(
            spec.norm, weights.final_norm, weights.final_norm_b, spec.norm_eps, prep)
        self.embed_norm = None if weights.embed_norm is None else Norm(
            spec.norm, weights.embed_norm, weights.embed_norm_b, spec.norm_eps, prep)
        # the LM head is a Linear like the others (quantized under w8, transposed at opt >= 1)
        self.lm_head = None if weights.lm_head is None else Lin([weights.lm_head],
                                                                [weights.lm_head_b], prep)
        if weights.lm_head is weights.embed:  # tied: the head may have moved the tensor
            self.embed_w = detach(weights.embed, dtype).to(device)
        self._cos = self._sin = None
        # reusable buffers of long CPU prefills (see kernels.Workspace)
        self.workspace = Workspace() if device.type == "cpu" and spec.kind == "decoder" else None
        self.stats = {"plans_built": 0, "plan_steps": 0, "general_steps": 0}
        self._decode_kv: Any = None  # forward_paged's kept decode KV (see .decode_kv)

    @classmethod
    def from_hf(cls, model: Any, **kw: Any) -> "ModelRunner":
        """Describe and extract a Hugging Face model (see :mod:`.arch`), then build."""
        arch = resolve_architecture(model.config)
        spec = arch.describe(model.config)
        return cls(spec, arch.extract(model, spec), **kw)

    # ------------------------------------------------------------------ helpers
    def new_cache(self, batch: int, capacity: int) -> ContiguousKVCache:
        """An empty contiguous cache for this model (from atb's memory pool)."""
        from .cache_int8 import Int8KVCache

        s = self.spec
        kind = Int8KVCache if self.kv_cache_dtype == "int8" else ContiguousKVCache
        return kind(s.num_layers, batch, capacity, s.num_kv_heads, s.head_dim, self.dtype,
                    self.device)

    def rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin ``[P >= length, rotary_dim]`` (neox "half" layout), built in
        float64 from the plugin frequencies, times the attention factor."""
        r = self.spec.rope
        if r.max_len is not None and length > r.max_len:
            raise CapabilityError("compile", f"rope_type {r.rope_type!r} past {r.max_len} "
                                  "positions (its frequencies change with the length)",
                                  f"positions < {r.max_len}", length)
        if self._cos is None or self._cos.shape[0] < length:
            size = max(length, 2 * (0 if self._cos is None else self._cos.shape[0]), 256)
            inv = torch.tensor(r.inv_freq, dtype=torch.float64)
            ang = torch.arange(size, dtype=torch.float64)[:, None] * inv[None]  # [P, rd/2]
            full = torch.cat([ang, ang], dim=-1)
            self._cos = (full.cos() * r.attention_factor).float().to(self.device)
            self._sin = (full.sin() * r.attention_factor).float().to(self.device)
        return self._cos, self._sin

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.embed_w.shape[0]):
            raise InputError("compile", "input_ids out of range",
                             f"ids in [0, {self.embed_w.shape[0]})",
                             f"[{int(ids.min())}, {int(ids.max())}]")

    def _check_positions(self, pos: torch.Tensor, table: Any, what: str) -> None:
        if table is not None and pos.numel() and int(pos.max()) >= table.shape[0]:
            raise InputError("compile", f"{what} past the position table",
                             f"< {table.shape[0]}", int(pos.max()))

    def embed(self, ids: torch.Tensor | None, positions: torch.Tensor,
              token_type_ids: torch.Tensor | None = None,
              inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Token (+ learned position, + token type) embeddings."""
        if inputs_embeds is not None:
            x = inputs_embeds.to(self.dtype)
        else:
            self._check_ids(ids)
            x = self.k_embed(weight=self.embed_w, ids=ids)[0]
        if self.spec.arch == "gpt2" and token_type_ids is not None:
            x = x + self.k_embed(weight=self.embed_w, ids=token_type_ids)[0]
        if self.type_w is not None:
            tt = token_type_ids if token_type_ids is not None else torch.zeros_like(positions)
            x = x + self.k_embed(weight=self.type_w, ids=tt)[0]
        if self.pos_w is not None:
            self._check_positions(positions, self.pos_w, "position_ids")
            x = x + self.k_embed(weight=self.pos_w, ids=positions)[0]
        return x

    def _cos_sin(self, positions: torch.Tensor) -> tuple[Any, Any]:
        if self.spec.rope is None:
            return None, None
        n = int(positions.max()) + 1 if positions.numel() else 1
        cos, sin = self.rope_tables(n)
        pos = positions if positions.dim() == 2 else positions[None]
        return cos[pos], sin[pos]                                       # [B|1, T, rd]

    # ------------------------------------------------------------------ decoder
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor | None = None, cache: ContiguousKVCache | None = None,
                *, position_ids: torch.Tensor | None = None, attention_mask: Any = None,
                inputs_embeds: torch.Tensor | None = None, token_type_ids: Any = None,
                logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
        """The general decoder path; see the module docstring."""
        src = input_ids if input_ids is not None else inputs_embeds
        b, t = src.shape[0], src.shape[1]
        start = cache.length if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(start, start + t, device=self.device)[None]
        x = self.embed(input_ids, position_ids, token_type_ids, inputs_embeds)
        if x.shape[0] != b:
            x = x.expand(b, *x.shape[1:])
        cos, sin = self._cos_sin(position_ids)
        ctx = AttnCtx(cos=cos, sin=sin, cache=cache, start=start,
                      ws=self.prefill_workspace(b * t))
        self._masks(ctx, attention_mask, b, t, start + t, position_ids, cache)
        if cache is not None:
            cache.reserve(start + t)
        # the rows whose logits are kept (HF's logits_to_keep: an int counts from the
        # end, 0 = all; a tensor indexes the tokens): the last block runs only those
        keep = logits_to_keep
        if isinstance(logits_to_keep, int):
            keep = slice(t - logits_to_keep, t) if 0 < logits_to_keep < t else None
        x, res = run_blocks(self.blocks, x, ctx, keep)
        h = self.final_norm.add(x, res)[0]
        if cache is not None:
            cache.length = start + t
        self.stats["general_steps"] += 1
        return h if self.lm_head is None else self.lm_head(h)

    def _masks(self, ctx: AttnCtx, mask: Any, b: int, t: int, total: int,
               position_ids: torch.Tensor, cache: Any) -> None:
        if mask is None:
            if cache is None and position_ids.shape[-1] > 1:
                pos = position_ids.reshape(-1, position_ids.shape[-1])
                if bool((pos.diff(dim=-1) != 1).any()):
                    raise CapabilityError("compile", "packed sequences in position_ids without "
                                          "an attention mask", "consecutive positions per row",
                                          "restarts")
            return
        if mask.dim() == 4:  # the caller's full mask: used as given, no causal part added
            ctx.mask, ctx.causal = mask if mask.dtype == torch.bool else mask.to(self.dtype), False
            return
        if mask.dim() != 2 or mask.shape[0] != b or mask.shape[1] < total:
            raise InputError("compile", "attention_mask shape", f"[{b}, >= {total}] (past + new "
                             "tokens) or 4-D", list(mask.shape))
        m = mask[:, :total].bool()
        if not bool(m.all()):
            ctx.mask = m[:, None, None, :]                              # [B, 1, 1, L]

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, cache: ContiguousKVCache,
                attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run a prompt batch into an empty (or partly filled) cache; returns the
        logits of each row's last token ``[B, V]``. With a 2-D ``attention_mask``
        (left padding) positions default to Hugging Face ``generate``'s
        ``cumsum(mask) - 1`` and the mask is remembered for :meth:`decode`."""
        start = cache.length
        b, t = input_ids.shape
        if attention_mask is not None:
            full = attention_mask.to(self.device).bool()
            if full.shape[1] == t and start:
                full = torch.cat([cache.mask(start) if cache.key_mask is not None else
                                  torch.ones(b, start, dtype=torch.bool, device=self.device),
                                  full], dim=1)
            if position_ids is None:
                pos = full.long().cumsum(-1) - 1
                position_ids = pos.masked_fill(~full, 0)[:, start:start + t]
            cache.reserve(start + t)
            cache.set_key_mask(0, full[:, :start + t])
            attention_mask = full
        logits = self.forward(input_ids, cache, position_ids=position_ids,
                              attention_mask=attention_mask, logits_to_keep=1)
        return logits[:, -1]

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, cache: ContiguousKVCache,
               positions: torch.Tensor | None = None,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """One new token per row (``ids`` [B] or [B, 1]); positions default to one
        past each row's last (remembered from :meth:`prefill`'s mask). Returns
        logits ``[B, V]`` — at opt >= 2 the plan's buffer (clone to keep it)."""
        from .plan import plan_for

        ids = ids.reshape(-1)
        cache.reserve(cache.length + 1)
        if positions is None:
            positions = self._next_positions(cache)
        positions = positions.reshape(-1)
        if attention_mask is not None:
            cache.set_key_mask(0, attention_mask.to(self.device).bool()[:, :cache.length + 1])
        else:
            cache.set_key_mask(cache.length, None)
        plan = plan_for(self, cache) if self.opt_level >= 2 else None
        if plan is not None:
            self.stats["plan_steps"] += 1
            return plan.step(ids, positions)
        m = cache.mask(cache.length + 1)
        logits = self.forward(ids[:, None], cache, position_ids=positions[:, None],
                              attention_mask=m)
        return logits[:, -1]

    def _next_positions(self, cache: ContiguousKVCache) -> torch.Tensor:
        n = cache.length
        if cache.key_mask is None:
            return torch.full((cache.batch,), n, dtype=torch.long, device=self.device)
        return cache.key_mask[:, :n].sum(dim=1)

    def prefill_workspace(self, tokens: int) -> Workspace | None:
        """The workspace for a forward of ``tokens`` rows: long CPU prefills reuse its
        buffers; decode-sized steps (the C few-row matmuls) need none."""
        return self.workspace if tokens > ROWS_MAX else None

    # ------------------------------------------------------------------ info
    def explain(self) -> str:
        """What runs: each Linear's kernels and weight layout, the attention kernels,
        the bytes a decode step reads (see :mod:`.explain`)."""
        from .explain import explain_runner

        return explain_runner(self)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the prepared weights read per decode step (the GEMV floor)."""
        n = 0
        for blk in self.blocks:
            for name in ("qkv", "q", "k", "v", "o", "gate_up", "gate", "up", "down"):
                lin = getattr(blk, name, None)
                if isinstance(lin, Lin):
                    n += lin.nbytes
        return n + (self.lm_head.nbytes if self.lm_head is not None else 0)

