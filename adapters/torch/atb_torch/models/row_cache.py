"""``RowKVCache``: the KV cache of a compiled Hugging Face decoder.

An :class:`atbcore.memory.KVCache` (one pool block ``[layers, 2, B, capacity, Hkv, D]``,
written in place by the model's core plan) whose rows hold **real tokens only**:
a left-padded batch is stored without its padding, so every row attends to its own
tokens and the plan needs no key mask. On top of it, the Hugging Face view of the
same cache: ``length`` counts the slots of the batch's shared time axis (padding
included, what ``get_seq_length`` answers) and ``key_mask`` ``[B, length]`` says
which of them are real (None: all are).

    cache = RowKVCache(num_layers=2, batch=2, capacity=256, num_kv_heads=2, head_dim=16,
                       dtype=torch.float32)
    runner.forward(ids, cache, attention_mask=mask)   # the runner writes it
    cache.length, cache.key_mask, cache.seq_lens()    # timeline, real slots, real tokens per row
    k = cache.hf_view(layer, 0)                       # [B, Hkv, length, D], zeros at padding

``kv_dtype="int8"``: keys and values stored as int8 with one fp16 scale per token and
KV head (:class:`atbcore.memory.KVCache` ``dtype="int8"``; the plan quantizes as it
writes and dequantizes what it reads); :meth:`hf_view` dequantizes into ``dtype``
and :meth:`write` quantizes.

``crop`` (assisted decoding), ``select`` (beam search) and ``reset`` act on both
views; ``reserve`` grows the block by doubling (its storage moves: ``version``
changes, so plans fetch the new views).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from atbcore.dtypes import Dtype
from atbcore.errors import CapabilityError, InputError
from atbcore.backends.torch.paged_int8 import quantize_int8
from atbcore.memory import KVCache
from atbcore.ops.paged_int8 import SCALE_DTYPE
from atbcore.tensor import convert

__all__ = ["RowKVCache"]


class RowKVCache(KVCache):
    """See the module docstring; ``dtype`` a torch dtype, ``device`` a torch device."""

    def __init__(self, num_layers: int, batch: int, capacity: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: Any = "cpu",
                 kv_dtype: str | None = None) -> None:
        dev = torch.device(device)
        if kv_dtype not in (None, "int8"):
            raise InputError("RowKVCache", "kv_dtype", "None or 'int8'", repr(kv_dtype))
        super().__init__(num_layers, batch, capacity, num_kv_heads, head_dim,
                         dtype=Dtype.INT8 if kv_dtype else Dtype.of(dtype),
                         device=str(dev) if dev.type != "cpu" else "cpu")
        self.torch_dtype, self.torch_device = dtype, dev
        self.length = 0                            # slots of the shared time axis
        self._mask: torch.Tensor | None = None     # [B, >= length] bool; None: all real
        self.version = 0

    @property
    def key_mask(self) -> torch.Tensor | None:
        """``[B, length]`` bool: which slots of the time axis are real (None: all)."""
        return None if self._mask is None else self._mask[:, :self.length]

    @key_mask.setter
    def key_mask(self, mask: torch.Tensor | None) -> None:
        self._mask = None if mask is None else mask.bool().clone()

    @property
    def batch(self) -> int:
        return self.max_batch

    @property
    def capacity(self) -> int:
        return self.max_seq_len

    def storage(self) -> torch.Tensor:
        """The whole block as a torch tensor ``[layers, 2, B, capacity, Hkv, D]``."""
        return convert(self._alive(), "torch")

    def _stores(self) -> list[torch.Tensor]:
        """Every block with the layout ``[layers, 2, B, capacity, ...]``: the rows, and
        an int8 cache's scales ``[layers, 2, B, capacity, Hkv]``."""
        out = [self.storage()]
        if self.quantized:
            out.append(convert(self._scales, "torch"))
        return out

    def real_lens(self) -> np.ndarray:
        """Real tokens per row (every layer holds the same): ``seq_lens(None, 0)`` read
        directly (a decode step reads it once)."""
        self._alive()
        return self._lens[0].copy()

    # ------------------------------------------------------------------ capacity
    def reserve(self, needed: int) -> None:
        """Room for ``needed`` tokens per row (the block doubles, its rows copied)."""
        if needed <= self.max_seq_len:
            return
        cap = max(int(needed), 2 * self.max_seq_len)
        shape = (self.num_layers, 2, self.max_batch, cap, self.num_kv_heads, self.head_dim)
        self._kv, self._block, kv_bytes = self._grown(self._kv, self._block, shape, self.dtype)
        nbytes = kv_bytes
        if self.quantized:
            self._scales, self._scale_block, scale_bytes = self._grown(
                self._scales, self._scale_block, shape[:-1], SCALE_DTYPE)
            nbytes += scale_bytes
        self.shape, self.nbytes, self.max_seq_len = shape, nbytes, cap
        self.version += 1

    def _grown(self, old: Any, old_block: Any, shape: tuple, dtype: Dtype) -> tuple:
        """A zeroed pool block of ``shape`` holding ``old``'s rows; the old one freed."""
        nbytes = int(np.prod(shape)) * dtype.itemsize
        block = self.pool.alloc(nbytes, pinned=True)
        t = block.tensor(shape, dtype)
        new = convert(t, "torch")
        new.zero_()
        new[:, :, :, :self.max_seq_len] = convert(old, "torch")
        old_block.free()
        return t, block, nbytes

    # ------------------------------------------------------------------ the timeline
    def extend(self, new_mask: torch.Tensor | None, count: int) -> None:
        """Append ``count`` slots to the timeline (``new_mask`` [B, count]: which are
        real; None: all)."""
        if new_mask is not None and bool(new_mask.all()):
            new_mask = None
        n = self.length
        if self._mask is None and new_mask is not None:
            self._mask = torch.ones(self.max_batch, n, dtype=torch.bool, device=new_mask.device)
        if self._mask is not None:
            if self._mask.shape[1] < n + count:  # grown by doubling: no copy per step
                more = torch.ones(self.max_batch, max(n + count, 2 * self._mask.shape[1]),
                                  dtype=torch.bool, device=self._mask.device)
                more[:, :n] = self._mask[:, :n]
                self._mask = more
            if new_mask is not None:
                self._mask[:, n:n + count] = new_mask.to(self._mask.device)
            else:
                self._mask[:, n:n + count] = True
        self.length = n + count

    def repad(self, past: torch.Tensor) -> None:
        """The caller's mask of the past slots ``[B, length]`` (True = real): real slots
        it now marks as padding are dropped from the rows; reviving a dropped slot
        raises CapabilityError (its keys are gone)."""
        stored = self.key_mask[:, :self.length] if self.key_mask is not None else None
        if stored is None:
            if bool(past.all()):
                return
            stored = torch.ones_like(past)
        past = past.to(stored.device)
        if torch.equal(past, stored):
            return
        if bool((past & ~stored).any()):
            raise CapabilityError("compile", "an attention_mask that marks padded cache slots "
                                  "as real", "the mask the cache was written with (or more "
                                  "padding)", "revived slots")
        for b in (past != stored).any(dim=1).nonzero().reshape(-1).tolist():
            for s in self._stores():
                keep = past[b][stored[b]].nonzero().reshape(-1).to(s.device)   # ranks kept
                s[:, :, b, :keep.numel()] = s[:, :, b].index_select(2, keep)
            self._lens[:, b] = keep.numel()
        if bool(past.all()):
            self._mask = None
        elif self._mask is None:
            self._mask = past.clone()
        else:
            self._mask[:, :self.length] = past

    def crop(self, keep: int) -> None:
        """Keep the first ``keep`` slots of the timeline (and the real tokens among them)."""
        keep = max(0, min(int(keep), self.length))
        if self._mask is None:
            self._lens = np.minimum(self._lens, keep)
        else:
            real = self._mask[:, :keep].sum(dim=1).cpu().numpy().astype(np.int64)
            self._lens = np.minimum(self._lens, real[None, :])
            if bool(self._mask[:, :keep].all()):
                self._mask = None
        self.length = keep

    def select(self, rows: torch.Tensor) -> None:
        """Rows ``rows`` (of this cache) become rows ``0..len(rows)-1`` (beam search)."""
        idx = torch.as_tensor(rows, dtype=torch.long).reshape(-1).cpu()
        if idx.numel() != self.max_batch or int(idx.min()) < 0 or \
                int(idx.max()) >= self.max_batch:
            raise InputError("RowKVCache", "select rows", f"{self.max_batch} row indices in "
                             f"0..{self.max_batch - 1}", idx.tolist())
        for s in self._stores():
            s.copy_(s.index_select(2, idx.to(s.device)))
        self._lens = self._lens[:, idx.numpy()].copy()
        if self._mask is not None:
            self._mask = self._mask[idx.to(self._mask.device)]

    def reset(self, seq_ids: Any = None) -> None:
        super().reset(seq_ids)
        if seq_ids is None:
            self.length, self._mask = 0, None

    # ------------------------------------------------------------------ Hugging Face's view
    def hf_view(self, layer: int, which: int) -> torch.Tensor:
        """Layer ``layer``'s keys (``which`` 0) or values (1) on the timeline:
        ``[B, Hkv, length, D]``, zeros at padding (a copy when there is padding)."""
        data = self.storage()[layer, which]                              # [B, cap, Hkv, D]
        n = self.length
        if self.quantized:  # dequantized rows up to the longest real row
            top = int(self.seq_lens(None, layer).max(initial=0))
            scale = convert(self._scales, "torch")[layer, which, :, :top, :, None]
            data = (data[:, :top].float() * scale.float()).to(self.torch_dtype)
        if self.key_mask is None:
            return data[:, :n].transpose(1, 2)
        lens = torch.as_tensor(self.seq_lens(None, layer), device=data.device)
        stored = torch.arange(data.shape[1], device=data.device)[None] < lens[:, None]
        out = data.new_zeros(data.shape[0], n, *data.shape[2:])
        out[self.key_mask[:, :n].to(data.device)] = data[stored[:, :data.shape[1]]]
        return out.transpose(1, 2)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Layer ``layer``'s rows from ``start``: ``k``/``v`` ``[B, T, Hkv, D]``, all real
        (a Hugging Face cache converted in)."""
        t = k.shape[1]
        if start + t > self.max_seq_len:
            self.reserve(start + t)
        s = self.storage()
        if self.quantized:
            scales = convert(self._scales, "torch")
            for which, x in ((0, k), (1, v)):
                q, sc = quantize_int8(x, scales.dtype)
                s[layer, which, :, start:start + t] = q
                scales[layer, which, :, start:start + t] = sc
        else:
            s[layer, 0, :, start:start + t] = k.to(s.dtype)
            s[layer, 1, :, start:start + t] = v.to(s.dtype)
        self._lens[layer, :] = start + t

    def __repr__(self) -> str:
        return (f"RowKVCache(layers={self.num_layers}, batch={self.max_batch}, "
                f"capacity={self.max_seq_len}, length={self.length}, "
                f"padded={self.key_mask is not None}{', int8' if self.quantized else ''})")
