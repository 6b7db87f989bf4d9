"""``KVCache``: a contiguous, preallocated key/value cache with per-sequence lengths.

One pinned pool block holds ``[num_layers, 2, max_batch, max_seq_len, Hkv, D]``; new
keys and values are written in place at each sequence's current length (no
concatenation per step), and attention reads views of the filled part.

    cache = KVCache(num_layers=2, max_batch=4, max_seq_len=2048, num_kv_heads=8,
                    head_dim=128, dtype="fp16")
    cache.append(layer, k, v)                 # k, v: [B, T, Hkv, D] (or [B, T, Hkv*D])
    k_all, v_all, lens = cache.get(layer)     # [B, max(lens), Hkv, D] views + lens [B]
    out, = FlashAttention(layout="BSND", causal=True).execute([q, k_all, v_all, lens])
    cache.reset(seq_id); cache.free()

``dtype="int8"``: keys and values are stored as int8 with one scale per token and KV
head (:mod:`atbcore.ops.paged_int8`: ``absmax / 127``, fp16), in a second pinned
block ``[num_layers, 2, max_batch, max_seq_len, Hkv]`` (:meth:`key_scales`,
:meth:`value_scales`): ``D + 2`` bytes per token and head. :meth:`append` quantizes
float keys/values, :meth:`get` returns dequantized fp32 copies; a GraphOp's
in-place cache form writes and reads it with ``ReshapeAndCacheInt8`` /
``PagedAttentionInt8``.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Sequence

import numpy as np

from ..dtypes import Dtype
from ..errors import DtypeError, InputError, MemoryError_, ParamsError, ShapeError
from ..tensor import convert, describe
from .cache_common import _free_held, check_positive_ints, native_ints, pool_for, to_backing
from .pool import Block, MemoryPool
from ..ops.paged_int8 import SCALE_DTYPE, dequantize_int8_np, quantize_int8_np

__all__ = ["KVCache"]

_OP = "KVCache"


class KVCache:
    """Contiguous KV cache; see the module docstring. Memory comes from ``pool`` or the
    process-wide pool (:func:`get_memory_pool`) when it is on ``device``."""

    def __init__(self, num_layers: int, max_batch: int, max_seq_len: int, num_kv_heads: int,
                 head_dim: int, dtype: Any = Dtype.FP16, device: str = "cpu",
                 pool: MemoryPool | None = None) -> None:
        check_positive_ints(_OP, num_layers=num_layers, max_batch=max_batch,
                            max_seq_len=max_seq_len, num_kv_heads=num_kv_heads, head_dim=head_dim)
        try:
            self.dtype = Dtype.of(dtype)
        except ValueError as e:
            raise ParamsError(_OP, "dtype", "a Dtype or dtype name", repr(dtype)) from e
        self.num_layers, self.max_batch, self.max_seq_len = num_layers, max_batch, max_seq_len
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.shape = (num_layers, 2, max_batch, max_seq_len, num_kv_heads, head_dim)
        kv_bytes = math.prod(self.shape) * self.dtype.itemsize
        scale_bytes = math.prod(self.shape[:-1]) * SCALE_DTYPE.itemsize if self.quantized else 0
        self.nbytes = kv_bytes + scale_bytes
        # (a private pool holds both blocks, each aligned)
        self.pool = pool_for(_OP, device, self.nbytes + (4096 if scale_bytes else 0), pool)
        # [kv block, scale block]: what the finalizer frees when the cache is dropped
        # unfreed (a generate() call's cache, say), once no view of them is alive
        self._held: list[Block | None] = [None, None]
        self._finalizer = weakref.finalize(self, _free_held, self._held, self.pool)
        # Pinned: views handed out stay valid even if the pool defragments.
        self._block = self.pool.alloc(kv_bytes, pinned=True)
        self._kv = self._block.tensor(self.shape, self.dtype)
        # Zeroed once: slots past a sequence's length are masked by attention, but
        # uninitialised bytes can hold NaN/Inf, and 0 * NaN would leak through.
        self._kv[...] = 0
        self._scale_block = None
        self._scales: Any = None
        if scale_bytes:
            self._scale_block = self.pool.alloc(scale_bytes, pinned=True)
            self._scales = self._scale_block.tensor(self.shape[:-1], SCALE_DTYPE)
            self._scales[...] = 0
        self.device = self.pool.device
        self._lens = np.zeros((num_layers, max_batch), dtype=np.int64)

    @property
    def _block(self) -> Block | None:
        return self._held[0]

    @_block.setter
    def _block(self, block: Block | None) -> None:
        self._held[0] = block

    @property
    def _scale_block(self) -> Block | None:
        return self._held[1]

    @_scale_block.setter
    def _scale_block(self, block: Block | None) -> None:
        self._held[1] = block

    # ------------------------------------------------------------------ checks
    def _alive(self) -> Any:
        if self._block is None:
            raise MemoryError_(_OP, "use of a freed cache", "a live KVCache", "freed")
        return self._kv

    @property
    def quantized(self) -> bool:
        """Whether keys/values are stored as int8 with scales (``dtype="int8"``)."""
        return self.dtype == Dtype.INT8

    def _seq_ids(self, seq_ids: Sequence[int] | None, n: int | None) -> list[int]:
        if type(seq_ids) is range and seq_ids.step == 1 and 0 <= seq_ids.start and \
                seq_ids.stop <= self.max_batch:  # rows a..b: valid and distinct as given
            return list(seq_ids)
        ids = list(range(n if n is not None else self.max_batch)) if seq_ids is None else \
            [int(s) for s in np.asarray(seq_ids).reshape(-1)]
        bad = [s for s in ids if not 0 <= s < self.max_batch]
        if bad or len(set(ids)) != len(ids):
            raise InputError(_OP, "seq_ids", f"distinct ids in 0..{self.max_batch - 1}", ids)
        return ids

    def _rows(self, seq_ids: Sequence[int] | None) -> list[int] | slice:
        """:meth:`_seq_ids`, as a slice for a valid unit-step ``range`` (or None: every
        row): basic indexing of the lengths, no fancy-index copies (the decode loop's
        case: every step reads and advances rows 0..B-1)."""
        if seq_ids is None:
            return slice(0, self.max_batch)
        if type(seq_ids) is range and seq_ids.step == 1 and 0 <= seq_ids.start and \
                seq_ids.stop <= self.max_batch:
            return slice(seq_ids.start, max(seq_ids.start, seq_ids.stop))
        return self._seq_ids(seq_ids, None)

    def _layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or \
                not 0 <= layer < self.num_layers:
            raise InputError(_OP, "layer", f"an int in 0..{self.num_layers - 1}", repr(layer))
        return int(layer)

    # ------------------------------------------------------------------ writing
    def append(self, layer: int, key: Any, value: Any, seq_ids: Sequence[int] | None = None,
               lengths: Sequence[int] | None = None) -> None:
        """Write ``key``/``value`` ``[B, T, Hkv, D]`` (or ``[B, T, Hkv*D]``) after each
        sequence's current length in ``layer``; ``lengths[b] <= T`` are the valid
        tokens of row b (right padding ignored). Checks everything before writing."""
        kv = self._alive()
        layer = self._layer(layer)
        kd, vd = describe(key), describe(value)
        for name, d in (("key", kd), ("value", vd)):
            if (not d.dtype.is_floating) if self.quantized else d.dtype != self.dtype:
                want = "a float dtype (quantized on the way in)" if self.quantized else \
                    self.dtype.name
                raise DtypeError(_OP, f"input {name!r} dtype", want, d.dtype.name)
            hd = self.num_kv_heads * self.head_dim
            ok = d.shape[2:] in ((self.num_kv_heads, self.head_dim), (hd,)) and d.rank in (3, 4)
            if not ok or d.shape[:2] != kd.shape[:2]:
                want = f"[B, T, {self.num_kv_heads}, {self.head_dim}] or [B, T, {hd}]"
                raise ShapeError(_OP, f"input {name!r} shape", want, list(d.shape))
        b, t = kd.shape[:2]
        ids = self._seq_ids(seq_ids, b)
        if len(ids) != b:
            raise InputError(_OP, "seq_ids (one per batch row)", b, len(ids))
        n = np.full(b, t, dtype=np.int64) if lengths is None else \
            np.asarray(lengths, dtype=np.int64).reshape(-1)
        if n.shape != (b,) or (n < 0).any() or (n > t).any():
            raise InputError(_OP, "lengths", f"{b} values in 0..{t}", np.asarray(lengths).tolist())
        start = self._lens[layer, ids]
        over = start + n > self.max_seq_len
        if over.any():
            i = int(np.argmax(over))
            raise ShapeError(_OP, f"sequence {ids[i]} of layer {layer} overflows max_seq_len",
                             f"<= {self.max_seq_len} tokens", int(start[i] + n[i]))
        if self.quantized:
            self._append_int8(layer, key, value, ids, start, n)
            self._lens[layer, ids] = start + n
            return
        k = to_backing(key, self.pool.backing.name, kv).reshape(b, t, self.num_kv_heads,
                                                                 self.head_dim)
        v = to_backing(value, self.pool.backing.name, kv).reshape(b, t, self.num_kv_heads,
                                                                   self.head_dim)
        if (n == t).all() and (start == start[0]).all():
            # One strided write for the common case (same length, same offset).
            s0 = int(start[0])
            kv[layer, 0, ids, s0:s0 + t] = k
            kv[layer, 1, ids, s0:s0 + t] = v
        else:
            for row, (sid, s0, cnt) in enumerate(zip(ids, start.tolist(), n.tolist())):
                kv[layer, 0, sid, s0:s0 + cnt] = k[row, :cnt]
                kv[layer, 1, sid, s0:s0 + cnt] = v[row, :cnt]
        self._lens[layer, ids] = start + n

    update = append

    def _append_int8(self, layer: int, key: Any, value: Any, ids: list[int],
                     start: np.ndarray, n: np.ndarray) -> None:
        """Quantize and write the valid rows of each sequence (checked by append)."""
        shape = (len(ids), -1, self.num_kv_heads, self.head_dim)
        for which, x in ((0, key), (1, value)):
            q, s = quantize_int8_np(np.asarray(convert(x, "numpy")).reshape(shape),
                                    SCALE_DTYPE.numpy)
            for row, (sid, s0, cnt) in enumerate(zip(ids, start.tolist(), n.tolist())):
                self._kv[layer, which, sid, s0:s0 + cnt] = to_backing(
                    q[row, :cnt], self.pool.backing.name, self._kv)
                self._scales[layer, which, sid, s0:s0 + cnt] = to_backing(
                    s[row, :cnt], self.pool.backing.name, self._scales)

    def advance(self, layer: int | range, count: int, seq_ids: Sequence[int] | None = None
                ) -> None:
        """Count ``count`` more tokens in ``layer`` (or a ``range`` of layers) for
        ``seq_ids`` (default: every row): for kernels that wrote them into
        :meth:`keys` / :meth:`values` in place. Checks everything before changing
        anything."""
        self._alive()
        lay = self._layers_of(layer)
        ids = self._rows(seq_ids)
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise InputError(_OP, "count", "an int >= 0", repr(count))
        cur = self._lens[lay, ids]  # a view for a row range (then updated in place)
        top = int(cur.max(initial=0)) + int(count)
        if top > self.max_seq_len:
            raise ShapeError(_OP, f"layer {layer} overflows max_seq_len",
                             f"<= {self.max_seq_len} tokens", top)
        if type(ids) is slice:
            cur += int(count)
        else:
            self._lens[lay, ids] = cur + int(count)

    def lens_view(self, layers: slice, rows: int) -> np.ndarray:
        """The live lengths of ``layers`` x rows ``0..rows-1`` (a view, no checks): for
        a caller that checked them once and keeps them in step with what it writes
        (the in-place cache form's steady decode steps)."""
        return self._lens[layers, :rows]

    # ------------------------------------------------------------------ reading
    def get(self, layer: int, seq_ids: Sequence[int] | None = None) -> tuple[Any, Any, Any]:
        """``(k, v, lens)`` of ``layer``: k, v ``[n, max(lens), Hkv, D]`` and int32 lens
        ``[n]`` (seq_lens of FlashAttention with ``layout="BSND"``). Views of the cache
        when ``seq_ids`` is a contiguous range (the default: all sequences), copies
        otherwise; an int8 cache gives dequantized fp32 copies."""
        kv = self._alive()
        layer = self._layer(layer)
        ids = self._seq_ids(seq_ids, None)
        lens = self._lens[layer, ids]
        s = max(int(lens.max(initial=0)), 1)
        if self.quantized:
            name = self.pool.backing.name
            k, v = (to_backing(dequantize_int8_np(np.asarray(convert(kv[layer, w, ids, :s],
                                                                     "numpy")),
                                                  np.asarray(convert(self._scales[layer, w, ids,
                                                                                  :s], "numpy"))
                                                  ).astype(np.float32), name, kv)
                    for w in (0, 1))
            return k, v, native_ints(lens, name, kv)
        if not ids or ids == list(range(ids[0], ids[0] + len(ids))):
            a = ids[0] if ids else 0
            k, v = kv[layer, 0, a:a + len(ids), :s], kv[layer, 1, a:a + len(ids), :s]
        else:
            k, v = kv[layer, 0, ids, :s], kv[layer, 1, ids, :s]
        return k, v, native_ints(lens, self.pool.backing.name, kv)

    def keys(self, layer: int) -> Any:
        """The whole key buffer of ``layer``: ``[max_batch, max_seq_len, Hkv, D]``."""
        return self._alive()[self._layer(layer), 0]

    def values(self, layer: int) -> Any:
        """The whole value buffer of ``layer``: ``[max_batch, max_seq_len, Hkv, D]``."""
        return self._alive()[self._layer(layer), 1]

    def key_scales(self, layer: int) -> Any:
        """The key scales of an int8 cache's ``layer``: ``[max_batch, max_seq_len, Hkv]``."""
        return self._scale_view(layer, 0)

    def value_scales(self, layer: int) -> Any:
        """The value scales of an int8 cache's ``layer``: ``[max_batch, max_seq_len, Hkv]``."""
        return self._scale_view(layer, 1)

    def _scale_view(self, layer: int, which: int) -> Any:
        self._alive()
        if not self.quantized:
            raise DtypeError(_OP, "scales of the cache (an int8 cache's)", "dtype int8",
                             self.dtype.name)
        return self._scales[self._layer(layer), which]

    def seq_lens(self, seq_ids: Sequence[int] | None = None, layer: int | range | None = None
                 ) -> np.ndarray:
        """Host int64 lengths (of the last layer unless ``layer`` is given; a ``range``
        of layers gives ``[layers, rows]``)."""
        self._alive()
        lay = self.num_layers - 1 if layer is None else self._layers_of(layer)
        return self._lens[lay, self._rows(seq_ids)].copy()

    def _layers_of(self, layer: int | range) -> int | slice:
        """A layer index, or a slice for a non-empty unit-step ``range`` of layers."""
        if type(layer) is range and layer.step == 1 and len(layer):
            self._layer(layer.start)
            return slice(layer.start, self._layer(layer.stop - 1) + 1)
        return self._layer(layer)

    # ------------------------------------------------------------------ lifetime
    def truncate(self, seq_id: int, length: int) -> None:
        """Forget tokens past ``length`` in every layer (e.g. rejected speculative tokens)."""
        self._alive()
        sid = self._seq_ids([seq_id], None)[0]
        if not 0 <= length <= self.max_seq_len:
            raise InputError(_OP, "length", f"0..{self.max_seq_len}", length)
        self._lens[:, sid] = np.minimum(self._lens[:, sid], length)

    def reset(self, seq_ids: Sequence[int] | int | None = None) -> None:
        """Empty sequences (all by default) so their slots can serve new requests."""
        self._alive()
        ids = self._seq_ids([seq_ids] if isinstance(seq_ids, (int, np.integer)) else seq_ids, None)
        self._lens[:, ids] = 0

    free_sequence = reset

    def bytes_used(self) -> int:
        """Bytes holding cached tokens (all layers, keys and values)."""
        per_token = 2 * self.num_kv_heads * (self.head_dim * self.dtype.itemsize + (
            SCALE_DTYPE.itemsize if self.quantized else 0))
        return int(self._lens.sum()) * per_token

    def free(self) -> None:
        """Return the memory to the pool; the cache cannot be used afterwards."""
        if self._block is not None:
            blk, self._block, self._kv = self._block, None, None
            blk.free()
            if self._scale_block is not None:
                sblk, self._scale_block, self._scales = self._scale_block, None, None
                sblk.free()
            if getattr(self.pool, "private", False):
                self.pool.release()

    destroy = release = free

    @property
    def freed(self) -> bool:
        return self._block is None

    def __enter__(self) -> "KVCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.free()

    def __repr__(self) -> str:
        return (f"KVCache(layers={self.num_layers}, batch={self.max_batch}, "
                f"max_seq_len={self.max_seq_len}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, {self.dtype.name}, {self.device})")
