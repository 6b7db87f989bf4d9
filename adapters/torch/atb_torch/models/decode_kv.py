"""``DecodeKV``: a contiguous copy of the running batch's keys and values, kept
across the decode steps of :meth:`.runner.ModelRunner.forward_paged`.

A decode step over a paged cache has to bring each sequence's blocks together
before batched attention can run; gathering them anew every step copies the whole
batch's KV (all layers) once per token. Between two decode steps of the same
batch, though, only one token per sequence is new. So the step's gathered KV is
kept, head-major ``[layers, 2, B, Hkv, capacity, D]`` (each head's keys contiguous
for the attention reads), and each later step writes just its new
token into it (besides the paged cache, which stays the source of truth):

    dk = DecodeKV(num_layers, num_kv_heads, head_dim, dtype, device)
    step = dk.begin(cache, batch)            # once per decode step (None: not usable)
    o = step.attend(layer, q, k, v, kc, vc, scale, window)   # per layer, after the
                                             # new k/v went into the paged cache

The copy is trusted only while nothing else could have changed it: the same cache
object, whose ``version`` (bumped by every cache edit outside ``forward_paged``'s
own writes: ``write``, block copies, adding / freeing / forking sequences) has not
moved, the same sequences in the same order, each exactly one token longer than at
the last step, and enough capacity. Otherwise the step rebuilds it from the blocks
(the gather the step would have done anyway). Its size is bounded by half the paged
cache's bytes; past that, ``begin`` returns None and the PagedAttention kernel
gathers per step as before.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from atbcore.backends.torch.paged import decode_mask, paged_decode_attention

__all__ = ["DecodeKV", "DecodeStep"]


class DecodeStep:
    """One decode step's view of a :class:`DecodeKV` (see the module docstring)."""

    def __init__(self, buf: torch.Tensor, lens: torch.Tensor, n: int, table: Any) -> None:
        self.buf, self.lens, self.n = buf, lens, n
        self.table = table                    # long [B, nblk] when rebuilding, else None
        b = lens.shape[0]
        self.rows = torch.arange(b, device=lens.device)
        self.at = lens - 1                     # slot of each sequence's new token
        self._masks: dict[int | None, torch.Tensor] = {}

    def mask(self, window: int | None) -> torch.Tensor:
        """Additive fp32 [B, n] mask (0 or -inf) of the keys each query sees, built
        once per step and window (SDPA runs a float mask faster than a bool one)."""
        m = self._masks.get(window)
        if m is None:
            allow = decode_mask(self.lens, self.n, window)
            m = torch.zeros(allow.shape, dtype=torch.float32, device=allow.device)
            m = self._masks[window] = m.masked_fill_(~allow, float("-inf"))
        return m

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kc: torch.Tensor, vc: torch.Tensor, scale: float,
               window: int | None) -> torch.Tensor:
        """Attention of ``q`` [B, H, D] (one new token per sequence) over the batch's
        keys/values; ``k``/``v`` [B, Hkv, D] are the new token's, already written to
        the paged caches ``kc``/``vc``. Returns [B, H, D]."""
        kb, vb = self.buf[layer, 0], self.buf[layer, 1]                  # [B, Hkv, cap, D]
        if self.table is not None:  # rebuild: this layer's blocks, new token included
            b, nblk = self.table.shape
            m = nblk * kc.shape[1]
            # gathered [B, nblk, BS, Hkv, D] -> [B, Hkv, nblk*BS, D]
            kb[:, :, :m].copy_(kc[self.table].flatten(1, 2).transpose(1, 2))
            vb[:, :, :m].copy_(vc[self.table].flatten(1, 2).transpose(1, 2))
        else:
            kb[self.rows, :, self.at] = k                                # k: [B, Hkv, D]
            vb[self.rows, :, self.at] = v
        # [B, Hkv, n, D] -> the [B, n, Hkv, D] view paged_decode_attention takes
        return paged_decode_attention(q, kb[:, :, :self.n].transpose(1, 2),
                                      vb[:, :, :self.n].transpose(1, 2), scale,
                                      allow=self.mask(window))


class DecodeKV:
    """See the module docstring."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: Any) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.buf: torch.Tensor | None = None  # [L, 2, B, Hkv, capacity, D]
        self._cache: Any = None               # weakref to the paged cache it mirrors
        self._version = -1
        self._seq_ids: list = []
        self._lens: list[int] = []
        self.rebuilds = 0

    def reset(self) -> None:
        """Forget the copy (memory included)."""
        self.buf, self._cache, self._seq_ids, self._lens = None, None, [], []

    def begin(self, cache: Any, batch: Any, lens: list[int]) -> DecodeStep | None:
        """Set up a decode step of ``batch`` (one new token per sequence, already
        given slots; ``lens`` its context lengths) over ``cache``; None when the copy
        would exceed its memory bound."""
        b, n = len(lens), max(lens)
        same = (self.buf is not None and self._cache is not None and self._cache() is cache
                and self._version == cache.version and self._seq_ids == batch.seq_ids
                and self.buf.shape[2] == b and n <= self.buf.shape[4]
                and all(x == y + 1 for x, y in zip(lens, self._lens)))
        table = None
        if not same:
            bs = cache.block_size
            cap = -(-(n + max(16, n // 4)) // bs) * bs  # headroom: a rebuild per >= 16 steps
            shape = (self.num_layers, 2, b, self.num_kv_heads, cap, self.head_dim)
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=self.dtype).element_size()
            if nbytes > cache.nbytes // 2:
                self.reset()
                return None
            if self.buf is None or self.buf.shape != shape:
                self.buf = None  # let the old copy go before the new one is taken
                self.buf = torch.empty(shape, dtype=self.dtype, device=self.device)
            nblk = -(-n // bs)
            # the layers copy slots < nblk*BS; the rest is written token by token, and
            # until then masked, but fresh memory may hold NaN and 0 * NaN would leak
            self.buf[:, :, :, :, nblk * bs:].zero_()
            nb = cache.num_blocks
            table = batch.block_tables[:, :nblk].to(self.device).long().clamp(0, nb - 1)
            self._cache = weakref.ref(cache)
            self.rebuilds += 1
        self._version = cache.version
        self._seq_ids, self._lens = list(batch.seq_ids), list(lens)
        lt = batch.context_lens.to(self.device).long()
        return DecodeStep(self.buf, lt, n, table)
