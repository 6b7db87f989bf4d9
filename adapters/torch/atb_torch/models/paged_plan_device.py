"""The decode step of continuous batching as a prebuilt plan on an accelerator: the
same bound calls as :class:`.plan.DecodePlan` (one residual buffer, fixed buffers for
the step's metadata), with the paged cache's ops on their device kernels:

    rope(q, k) in place in qkv                        # Triton on CUDA, npu_rotary_mul on NPU
    k, v -> their slots in the blocks                 # see below
    x += o(paged_attention(q, blocks, tables, lens))  # Triton split-K decode / torch_npu's op

On CUDA at ``opt_level`` 3 the plan is captured as one CUDA graph (``graph_safe``): the
cache write is then an ``index_copy_`` into the flattened blocks (no host sync; a decode
step's slots are all real), the Triton decode kernel reads the context lengths from the
plan's device buffer and picks its split count from the table width, so one capture
serves every step of the same batch size and table width. Without capture the write is
the ReshapeAndCache op (``_npu_reshape_and_cache`` on an NPU). A step of another batch
size, or needing a wider table, builds (and captures) a new plan.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from atbcore.log import logger

from .paged_plan import PagedDecodePlan
from .plan import DecodePlan

__all__ = ["DevicePagedDecodePlan", "device_paged_plan_for"]


def device_paged_plan_for(runner: Any, cache: Any, batch: Any) -> "DevicePagedDecodePlan | None":
    """The plan of this decode step (one token per sequence) when the PagedAttention
    op's device kernel takes it (``runner._device_paged_decode``), built or reused;
    None otherwise (then the general path runs)."""
    s, b, need = runner.spec, len(batch.seq_ids), batch.block_tables.shape[1]
    plan = runner.__dict__.get("_paged_plan")
    if isinstance(plan, DevicePagedDecodePlan) and plan.fits(cache, b, need):
        return plan  # decided when it was built: same cache, batch size and kernels
    if (runner.opt_level < 2 or runner.lm_head is None or s.kind != "decoder"
            or (s.rope is not None and s.rope.rotary_dim != s.head_dim)
            or any(blk.router is not None for blk in runner.blocks)
            or not runner._device_paged_decode(cache, batch)):
        return None
    width = 1 << max(0, need - 1).bit_length()                     # next power of two
    if s.rope is not None and s.rope.max_len is not None \
            and width * cache.block_size >= s.rope.max_len:
        return None
    runner._paged_plan = None  # the old plan's memory goes first
    graph = runner.opt_level >= 3 and runner.device.type == "cuda"
    plan = runner._paged_plan = DevicePagedDecodePlan(runner, cache, b, width, graph_safe=graph)
    runner.stats["plans_built"] += 1
    return plan


class DevicePagedDecodePlan(PagedDecodePlan):
    """See the module docstring. ``graph_safe``: host-sync-free calls only, and on CUDA
    the step captured as a CUDA graph on its first run."""

    def __init__(self, runner: Any, cache: Any, batch: int, width: int,
                 graph_safe: bool = False) -> None:
        dev = runner.device
        self.width, self.block_size, self.graph_safe = width, cache.block_size, graph_safe
        self.kc_ptr = cache.key_cache(0).data_ptr()
        self.slots = torch.zeros(batch, dtype=torch.long if graph_safe else torch.int32,
                                 device=dev)
        # the lengths where the kernel reads them: on the device for Triton (and the
        # graph), on the host for torch_npu's ops (host ints / a host tensor)
        from atbcore.backends.npu import kernel_device

        self.lens = torch.ones(batch, dtype=torch.int32,
                               device="cpu" if kernel_device(dev.type) == "npu" else dev)
        self.tables = torch.zeros(batch, width, dtype=torch.int32, device=dev)
        # the index tensors above live on the device: PagedDecodePlan's own (host ones)
        # are not made; fits / positions / cache dtype are PagedDecodePlan's
        DecodePlan.__init__(self, runner, cache, static=False, batch=batch)
        self.captured = False

    def _c_attn_reason(self) -> str:
        return "the paged cache's device kernels"

    def _attend_layer(self, blk: Any, qkv: torch.Tensor) -> None:
        s, b = self.runner.spec, self.b
        qs, ks, nh, nkv, hd = s.q_size, s.kv_size, s.num_heads, s.num_kv_heads, s.head_dim
        self._rope_step(blk, qkv)
        k, v = qkv[:, qs:qs + ks].view(b, nkv, hd), qkv[:, qs + ks:].view(b, nkv, hd)
        kc, vc = self.cache.key_cache(blk.idx), self.cache.value_cache(blk.idx)
        if self.graph_safe:  # [NB * BS, KV, D] rows at the step's slots
            for cache, new in ((kc, k), (vc, v)):
                self._call(functools.partial(cache.view(-1, nkv, hd).index_copy_, 0,
                                             self.slots, new))
        else:
            self._call(lambda: blk.rac(key=k, value=v, key_cache=kc, value_cache=vc,
                                       slot_mapping=self.slots))
        q = qkv[:, :qs].view(b, nh, hd)
        self._acc(blk.o, lambda: blk.pa(query=q, key_cache=kc, value_cache=vc,
                                        block_tables=self.tables,
                                        context_lens=self.lens)[0].reshape(b, qs), 1)

    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up (Triton compiles): rewrites this step's slots only
                self._run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._run()
        logger.debug("paged decode plan captured: batch %d, %d table columns", self.b,
                     self.width)

    def step(self, ids: torch.Tensor, positions: torch.Tensor, batch: Any) -> torch.Tensor:
        """One token per sequence of ``batch`` (its :class:`PagedBatch`): writes the
        tokens' keys and values into the blocks; returns logits ``[B, V]`` (this
        buffer is rewritten by the next step)."""
        self.tables.zero_()  # a captured step reads every column
        self._load(ids, positions, batch)
        if self.graph_safe and not self.captured and self.ids.is_cuda:
            self.captured = True
            self._capture()
        self._execute()
        return self.logits
