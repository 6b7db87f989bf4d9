"""The continuous-batching half of :class:`.runner.ModelRunner`: ``forward_paged``
over :class:`atbcore.memory.PagedKVCache`, and the per-step context its layers read.

A mixin so the runner's file keeps one concern per part (contiguous-cache serving
and encoders there, paged serving here); it uses the runner's ``spec``, ``device``,
``blocks``, ``embed``, ``_cos_sin``, ``final_norm``, ``lm_head`` and ``_decode_kv``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from atbcore.backends.cpu_kernels import torch_ops as ck
from atbcore.backends.cpu_kernels.threads import parked_torch_threads

from .kernels import ROWS_MAX
from .layers import run_blocks

__all__ = ["PagedCtx", "PagedMixin", "c_paged_decode"]


def c_paged_decode(cache: Any, spec: Any) -> bool:
    """True when PagedAttention's C kernel serves this cache's decode steps (CPU,
    fp32/bf16/fp16, head_dim <= 512): it reads the blocks in place, so no kept copy."""
    return ck.why_not(cache.key_cache(0), cache.value_cache(0)) is None and spec.head_dim <= 512


class PagedCtx:
    """Per-step inputs of :meth:`ModelRunner.forward_paged` shared by the layers."""

    paged = True

    def __init__(self, cos: Any, sin: Any, cache: Any, batch: Any,
                 fresh_lens: list[int] | None = None, decode: Any = None,
                 ws: Any = None) -> None:
        self.cos, self.sin, self.cache, self.batch = cos, sin, cache, batch
        self.ws = ws  # the runner's prefill Workspace (None: every tensor allocated)
        # new tokens per sequence when each context is exactly its new tokens
        self.fresh_lens = fresh_lens
        self.decode = decode  # a DecodeStep when the step is one token per sequence


class PagedMixin:
    """:meth:`forward_paged` and its kept decode KV (see the module docstring)."""

    @torch.no_grad()
    def forward_paged(self, input_ids: torch.Tensor, batch: Any, cache: Any,
                      all_logits: bool = False) -> torch.Tensor:
        """Packed new tokens ``input_ids`` [T] of ``batch.seq_ids`` (a ``PagedBatch``
        from ``cache.prepare_prefill`` / ``prepare_decode``); writes their keys and
        values into the paged ``cache`` and returns logits ``[B, V]`` of each
        sequence's last new token (``[T, V]`` with ``all_logits``). A step of one token
        per sequence runs as a prebuilt plan: of C kernels on the CPU
        (:mod:`.paged_plan`), of the device kernels elsewhere, captured as a CUDA graph
        at opt 3 (:mod:`.paged_plan_device`)."""
        pos = batch.positions.to(self.device).long()
        if input_ids.numel() == len(batch.seq_ids):  # one token per sequence: a decode step
            from .paged_plan import paged_plan_for
            from .paged_plan_device import device_paged_plan_for

            plan = paged_plan_for(self, cache, batch) if self.device.type == "cpu" else None
            if plan is None:  # the accelerator's kernels (a CUDA graph at opt 3)
                plan = device_paged_plan_for(self, cache, batch)
            if plan is not None:
                self.stats["plan_steps"] += 1
                return plan.step(input_ids.reshape(-1), pos, batch).clone()
        x = self.embed(input_ids.reshape(-1)[None].to(self.device), pos[None])   # [1, T, H]
        cos, sin = self._cos_sin(pos[None])
        # a prefill with no cached context attends over its packed tokens directly
        ql = [int(n) for n in batch.q_seq_lens.tolist()]
        lens = [int(n) for n in batch.context_lens.tolist()]
        fresh = ql if max(ql) > 1 and ql == lens else None
        ctx = PagedCtx(cos, sin, cache, batch, fresh, self._decode_step(cache, batch, ql, lens),
                       self.prefill_workspace(x.shape[1]))
        # only each sequence's last token is wanted: the last block runs those rows
        keep = None if all_logits or len(ql) == x.shape[1] else \
            batch.q_seq_lens.to(self.device).long().cumsum(0) - 1
        with self.parked(x.shape[1]):
            x, res = run_blocks(self.blocks, x, ctx, keep)
            h = self.final_norm.add(x, res)[0][0]                        # [B|T, H]
            return h if self.lm_head is None else self.lm_head(h)

    def parked(self, tokens: int) -> Any:
        """A context for a step of ``tokens`` rows: when its Linears run as the C
        matmuls (few rows), torch's pool is parked meanwhile (its spinning OpenMP
        workers would hold the cores the C pool needs: see
        ``cpu_kernels.threads.parked_torch_threads``); else nothing. Callers extend it over the
        sampling that follows a decode step, whose torch ops would wake the pool."""
        if self.lm_head is not None and self.lm_head.rows and tokens <= ROWS_MAX:
            return parked_torch_threads()
        return contextlib.nullcontext()

    def _decode_step(self, cache: Any, batch: Any, ql: list[int], lens: list[int]) -> Any:
        """The kept decode copy's step (:mod:`.decode_kv`) when every sequence has one
        new token and the blocks would otherwise be gathered, else None (then the
        PagedAttention kernel runs: on the CPU a C kernel that reads the blocks in
        place, which needs no copy; on an NPU torch_npu's paged op, when it takes
        the step)."""
        if max(ql) != 1 or getattr(cache, "version", None) is None:
            return None
        if c_paged_decode(cache, self.spec) or self._device_paged_decode(cache, batch):
            return None
        if self._decode_kv is None:
            from .decode_kv import DecodeKV

            s = self.spec
            self._decode_kv = DecodeKV(s.num_layers, s.num_kv_heads, s.head_dim,
                                       cache.key_cache(0).dtype, self.device)
        return self._decode_kv.begin(cache, batch, lens)

    def _device_paged_decode(self, cache: Any, batch: Any) -> bool:
        """Whether a device kernel of PagedAttention (torch_npu's) takes this decode
        step, asked with a query-shaped probe (no data is read)."""
        from atbcore.backends.torch.device_kernels import device_kernel_takes

        s, kc = self.spec, cache.key_cache(0)
        probe = torch.empty(len(batch.seq_ids), s.num_heads, s.head_dim, dtype=kc.dtype,
                            device=kc.device)
        return device_kernel_takes("PagedAttention", self.blocks[0].pa.p, {
            "query": probe, "key_cache": kc, "value_cache": cache.value_cache(0),
            "block_tables": batch.block_tables, "context_lens": batch.context_lens,
            "q_seq_lens": batch.q_seq_lens})

    def release_decode_kv(self) -> None:
        """Drop :meth:`forward_paged`'s kept decode KV (its memory goes now; the next
        decode step rebuilds it from the paged cache)."""
        if self._decode_kv is not None:
            self._decode_kv.reset()
        self.__dict__.pop("_paged_plan", None)  # and the paged decode plan's buffers
        if self.workspace is not None:          # and the prefill workspace
            self.workspace.release()
