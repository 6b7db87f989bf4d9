"""The decode step of continuous batching as a prebuilt plan (CPU, C kernels).

:meth:`.runner_paged.PagedMixin.forward_paged` on a step with one new token per
sequence runs the same bound calls as :class:`.plan.DecodePlan` (the residual
stream in one buffer, RmsNorm inside the C matmul, residual adds inside it), with
the paged cache's own kernels for the attention part of each layer:

    rope(q, k) in place in qkv                      # C, per-row cos/sin
    reshape_and_cache(k, v -> slots)                # C row copies into the blocks
    x += o(paged_attention(q, blocks, tables, lens)) # C, blocks read in place

The step's metadata (token ids, positions, slots, block tables, context lengths)
is copied into the plan's buffers, so the calls stay bound. A plan serves one
cache, one batch size and block tables up to ``width`` blocks; a step outside that
builds a new one (widths grow in powers of two).
"""

from __future__ import annotations

from typing import Any

import torch

from atbcore.backends.cpu_kernels import torch_ops as ck
from atbcore.backends.cpu_kernels.torch_decode import (paged_decode_attention,
                                                       reshape_and_cache_bound, rope_bound)

from .kernels import ROWS_MAX
from .plan import DecodePlan

__all__ = ["PagedDecodePlan", "paged_plan_for"]


def paged_plan_for(runner: Any, cache: Any, batch: Any) -> "PagedDecodePlan | None":
    """The plan for this decode step of ``batch`` (one token per sequence) over the
    paged ``cache``, built or reused; None when this model or step has none."""
    from . import runner_paged

    b = len(batch.seq_ids)
    why = PagedDecodePlan.unsupported_reason(runner, False)
    if not runner_paged.c_paged_decode(cache, runner.spec):
        return None
    kc = cache.key_cache(0)
    if (why or b > ROWS_MAX or runner.lm_head is None or not runner.lm_head.rows
            or ck.why_not(kc) is not None or runner.opt_level < 2 or kc.dtype != runner.dtype
            or runner.spec.head_dim > 512):
        return None
    need = batch.block_tables.shape[1]
    width = 1 << max(0, need - 1).bit_length()                    # next power of two
    rope = runner.spec.rope
    if rope is not None and rope.max_len is not None and width * cache.block_size >= rope.max_len:
        return None  # tables past max_len would be refused; the general path checks per step
    plan = runner.__dict__.get("_paged_plan")
    if plan is not None and plan.fits(cache, b, need):
        return plan
    runner._paged_plan = None                                      # the old plan's memory goes first
    plan = runner._paged_plan = PagedDecodePlan(runner, cache, b, width)
    runner.stats["plans_built"] += 1
    return plan


class PagedDecodePlan(DecodePlan):
    """See the module docstring."""

    def __init__(self, runner: Any, cache: Any, batch: int, width: int) -> None:
        self.width, self.block_size = width, cache.block_size
        self.kc_ptr = cache.key_cache(0).data_ptr()
        self.slots = torch.zeros(batch, dtype=torch.int32)
        self.lens = torch.zeros(batch, dtype=torch.int32)
        self.tables = torch.zeros(batch, width, dtype=torch.int32)
        super().__init__(runner, cache, static=False, batch=batch)

    def fits(self, cache: Any, batch: int, blocks: int) -> bool:
        """True when a step of ``batch`` sequences needing ``blocks`` table columns
        over ``cache`` can run on this plan."""
        return (self.cache is cache and self.b == batch and blocks <= self.width
                and cache.key_cache(0).data_ptr() == self.kc_ptr)

    def _positions(self) -> int:
        return self.width * self.block_size + 1

    def _cache_dtype(self) -> torch.dtype:
        return self.cache.key_cache(0).dtype

    def _attend_layer(self, blk: Any, qkv: torch.Tensor) -> None:
        s, b = self.runner.spec, self.b
        qs, ks, hd, nh = s.q_size, s.kv_size, s.head_dim, s.num_heads
        q, k, v = qkv[:, :qs], qkv[:, qs:qs + ks], qkv[:, qs + ks:]
        kc, vc = self.cache.key_cache(blk.idx), self.cache.value_cache(blk.idx)
        if s.rope is not None:  # q and k rotated in place (arguments packed once)
            self._call(rope_bound(q, k, self.cos, self.sin, head_dim=hd,
                                  rotary_dim=s.rope.rotary_dim))

        write = reshape_and_cache_bound(k, v, kc, vc, self.slots)  # arguments packed once
        if write is None:
            raise RuntimeError("paged plan: ReshapeAndCache refused the plan's own buffers")
        self._call(write)
        out = torch.empty(b, nh, hd, dtype=qkv.dtype)
        qh, win = q.view(b, nh, hd), blk.window
        scale = blk.scale if blk.scale is not None else hd ** -0.5
        self._acc(blk.o, lambda: paged_decode_attention(
            qh, kc, vc, self.tables, self.lens, scale=scale, window=win, out=out).view(b, qs), 1,
            out.view(b, qs))

    def step(self, ids: torch.Tensor, positions: torch.Tensor, batch: Any) -> torch.Tensor:
        """One token per sequence of ``batch`` (its :class:`PagedBatch`): writes the
        tokens' keys and values into the blocks; returns logits ``[B, V]`` (this
        buffer is rewritten by the next step)."""
        self._load(ids, positions, batch)
        self._execute()
        return self.logits

    def _load(self, ids: torch.Tensor, positions: torch.Tensor, batch: Any) -> None:
        """The step's inputs into the plan's own index tensors."""
        self.ids.copy_(ids)
        self.pos.copy_(positions)
        self.slots.copy_(batch.slot_mapping)
        self.lens.copy_(batch.context_lens)
        self.tables[:, :batch.block_tables.shape[1]].copy_(batch.block_tables)
