"""Feeding a GraphOp's in-place cache form from a KV cache, rows of any lengths.

The in-place form (:func:`atbcore.graph.sequential.lower_sequential` with a cache
descriptor) reads its tokens token-major ``[T, ...]`` and per block the index
tensors of :data:`~atbcore.graph.sequential.CACHE_INDEX`: ``slot_mapping [T]``
(cache row ``b`` is block ``b``: slot ``b * capacity + position``),
``block_tables [B, 1]``, ``context_lens [B]`` and ``q_seq_lens [B]``; the RoPE
``position_ids [T]``; with a :class:`~atbcore.graph.layers_block.LastToken`,
``cache.last_rows [B]`` (each row's last token). :class:`CacheFeeder` makes them
for a call from the cache's per-row lengths:

* ``x`` ``[B, S, ...]``: every row gets ``S`` new tokens, after its own past (rows
  may hold different lengths: a batch whose prompts had different lengths);
* ``x`` packed ``[T, ...]`` with ``q_lens`` (``B`` ints summing to ``T``): row ``b``
  gets ``q_lens[b]`` tokens (a left-padded batch given without its padding);
* ``rows``: which cache row each batch row is (default ``0..B-1``): a server runs the
  rows of its running requests, wherever they sit in the cache.

The index tensors are kept per (framework, device, capacity, batch, tokens per row)
and moved forward in place as the rows grow, so decode steps feed the very tensors
the bound program packed (no repacking, no allocation).

**A paged cache** (:class:`atbcore.memory.PagedKVCache`, blocks ``[num_blocks,
block_size, Hkv, D]`` per layer) feeds the same graph through
:meth:`CacheFeeder.prepare_paged`: the packed new tokens of several sequences (prefill
chunks and decode tokens mixed) with the step's
:class:`~atbcore.memory.paged.PagedBatch` (its slot mapping, block tables, context
and new-token lengths, positions, made by the block manager, which also counts the
tokens; :mod:`.graph_op_paged` makes the index tensors). ``cache.last_rows`` then
picks each sequence's last new token, or, with ``all_logits``, every token
(speculative verification reads them all).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ..dtypes import Dtype
from ..errors import DtypeError, InputError, ShapeError
from ..tensor import convert, copy_into, describe, framework_of, raw_signature, reshape
from .ir import Graph
from .graph_op_checks import _ints, _q_lens, _rows
from .sequential import BLOCK_INPUT

__all__ = ["CacheFeeder", "LAST_ROWS", "cache_state", "layer_kv"]

LAST_ROWS = "cache.last_rows"  # int64 [B]: each row's last token (LastToken's gather)
_MAX_INDEX_SETS = 64  # index tensor sets kept per cache

# cache object -> (version, {(framework, layer): (keys, values) views}, {key: _IndexSet}):
# every block of a step, and every step, reads the same tensors (bound programs pack
# their addresses once); a cache that moved its storage (version) gets fresh ones
_CACHE_STATE: "weakref.WeakKeyDictionary[Any, tuple[int, dict, dict]]" = \
    weakref.WeakKeyDictionary()


def layer_kv(cache: Any, layer: int) -> tuple[Any, Any]:
    """The key and value tensors of one cache layer: ``[max_batch, max_seq_len, Hkv,
    D]`` rows of a ``KVCache``, ``[num_blocks, block_size, Hkv, D]`` blocks of a
    ``PagedKVCache`` (both read as blocks by ``PagedAttention``)."""
    if hasattr(cache, "key_cache"):
        return cache.key_cache(layer), cache.value_cache(layer)
    return cache.keys(layer), cache.values(layer)


def _paged(cache: Any) -> bool:
    return hasattr(cache, "key_cache") and hasattr(cache, "manager")


def cache_state(cache: Any) -> tuple[dict, dict]:
    """(views, index sets) kept for ``cache`` (fresh after its storage moved; a
    paged cache's storage never moves: its version counts edits of its tables)."""
    version = 0 if _paged(cache) else getattr(cache, "version", 0)
    state = _CACHE_STATE.get(cache)
    if state is None or state[0] != version:
        state = _CACHE_STATE[cache] = (version, {}, {})
    return state[1], state[2]


class _IndexSet:
    """The index tensors for one (framework, device, capacity, B, tokens per row):
    NumPy arrays and the framework's tensors of them (sharing memory where they can,
    so a new past is written into them in place)."""

    def __init__(self, x: Any, cap: int, q: tuple[int, ...], p: np.ndarray,
                 rows: tuple[int, ...]) -> None:
        b = len(q)
        self.row_of = np.repeat(np.arange(b), q)                    # [T] row of each token
        offset = np.arange(len(self.row_of)) - np.repeat(np.cumsum(q) - q, q)
        pos = p[self.row_of] + offset
        self.offset, self.custom = offset, False  # custom: positions the caller gave
        qa, ra = np.asarray(q, dtype=np.int64), np.asarray(rows, dtype=np.int64)
        self.arrays = [(ra[self.row_of] * cap + pos).astype(np.int32),
                       ra.astype(np.int32)[:, None], (p + qa).astype(np.int32),
                       qa.astype(np.int32), pos.astype(np.int64), np.cumsum(qa) - 1]
        self.p, self.where = p.copy(), (framework_of(x), getattr(x, "device", None))
        self.one_each = len(self.row_of) == b  # a decode step: token t is row t
        self.tensors = [_on(*self.where, a) for a in self.arrays]
        self.shared = all(_shares(t, a) for t, a in zip(self.tensors, self.arrays))

    def at(self, p: np.ndarray, positions: np.ndarray | None = None) -> list:
        """The tensors for pasts ``p``; RoPE ``positions`` [T] when the caller gives
        them (else each token's cache slot)."""
        delta = p - self.p
        moved = bool(delta.any())
        if moved:  # in place, no temporaries: a decode step makes this once
            self.p += delta
            per_token = delta if self.one_each else delta[self.row_of]
            self.arrays[0] += per_token                    # slots (int32 += int64)
            self.arrays[2] += delta                        # context lengths
            if not self.custom:
                self.arrays[4] += per_token                # positions
        if positions is not None:
            self.arrays[4][:] = positions
        elif self.custom:
            self.arrays[4][:] = p[self.row_of] + self.offset
        changed = moved or positions is not None or self.custom
        self.custom = positions is not None
        if changed and not self.shared:
            if self.where[0] == "torch":  # device tensors keep their addresses (a captured
                for t, a in zip(self.tensors, self.arrays):  # step reads them there)
                    copy_into(t, a)
            else:
                self.tensors = [_on(*self.where, a) for a in self.arrays]
        return self.tensors


def _shares(t: Any, a: np.ndarray) -> bool:
    if t is a:
        return True
    ptr = getattr(t, "data_ptr", None)
    return ptr is not None and getattr(t, "device", None) is not None and \
        str(t.device) == "cpu" and ptr() == a.ctypes.data


def _on(framework: str, dev: Any, arr: np.ndarray) -> Any:
    """``arr`` as a ``framework`` tensor on device ``dev`` (None: the default)."""
    t = convert(arr, framework)
    if dev is not None and hasattr(t, "to") and str(getattr(t, "device", "cpu")) != str(dev):
        t = t.to(dev)
    return t


def _as(x: Any, t: Any) -> Any:
    """A cache tensor as ``x``'s framework (zero-copy where possible)."""
    return convert(t, framework_of(x))


def _span(layers: list[int]) -> range | None:
    """Consecutive cache layers as one range (read and counted in one call)."""
    if layers and layers[-1] - layers[0] == len(layers) - 1:
        return range(layers[0], layers[-1] + 1)
    return None


class CacheFeeder:
    """Feeds an in-place cache form graph (see the module docstring) from a
    ``KVCache`` and counts the tokens its plan wrote. ``layers`` assigns the
    cache's layer indices (the block's concatenating-form
    :class:`~atbcore.graph.graph_op_kv.KVBinder`, so both forms use the same layers)."""

    def __init__(self, graph: Graph, layers: Any) -> None:
        from .sequential import CACHE_INDEX, cache_slots

        self.graph, self.layers = graph, layers
        self.slots = cache_slots(graph)
        self.index = CACHE_INDEX + ((LAST_ROWS,) if LAST_ROWS in graph.inputs else ())
        self._x_at = graph.inputs.index(BLOCK_INPUT)
        # (ids of the tensors, the graph inputs with x left out, their raw signatures
        # before and after x)
        self._template: tuple | None = None
        self.raw: tuple | None = None  # the last prepared call's raw signature
        # the last plain call's state (cache, version, x shape, index set, layer slice,
        # pairs, shape): a decode loop's next step skips the checks it passed
        self._steady: tuple | None = None
        # the last steady step's block input and its token-major view: a caller that
        # feeds the same tensor each step (its own buffer) gets the same view, so the
        # bound program's native run sees the input it was recorded with
        self._x_view: tuple = (None, None)
        # the last assembled call: (index tensor list, pairs, block input, inputs, raw)
        self._last: tuple | None = None
        if len(self.slots) != len(layers.slots):
            raise InputError(graph.name, "attention layers with a KV cache", len(layers.slots),
                             len(self.slots))

    def _pairs(self, x: Any, cache: Any, views: dict, layers: list[int]) -> list:
        fw = framework_of(x)
        pairs = [views.get((fw, layer)) for layer in layers]
        if getattr(cache, "freed", False) or None in pairs:
            want = describe(x).dtype  # token ids: the cache write's own dtype check runs
            quantized = getattr(cache, "quantized", False)  # int8: any float block input
            if want.is_floating and not quantized and Dtype.of(cache.dtype) != want:
                raise DtypeError(self.graph.name, "atb.KVCache dtype (the block input's)",
                                 want.name, Dtype.of(cache.dtype).name)
            # (keys, values) per layer, and an int8 cache's (key scales, value scales)
            pairs = [tuple(_as(x, t) for t in layer_kv(cache, layer)) + (
                (_as(x, cache.key_scales(layer)), _as(x, cache.value_scales(layer)))
                if quantized else ()) for layer in layers]
            views.update(((fw, layer), kv) for layer, kv in zip(layers, pairs))
        return pairs

    def _past(self, cache: Any, rows: tuple[int, ...], layers: list[int]) -> np.ndarray:
        """Each row's past length (checked equal across the block's layers)."""
        name, b = self.graph.name, len(rows)
        span, ids = _span(layers), list(rows)
        lens = cache.seq_lens(ids, span) if span is not None else \
            np.stack([cache.seq_lens(ids, layer) for layer in layers])
        lens = np.asarray(lens, dtype=np.int64).reshape(-1, b)
        if (lens != lens[0]).any():
            layer = layers[int(np.argwhere((lens != lens[0]).any(axis=1))[0][0])]
            raise InputError(name, f"KVCache layer {layer} lengths",
                             f"the lengths of layer {layers[0]} (the block's first)",
                             lens[list(layers).index(layer)].tolist())
        return lens[0]

    def prepare(self, x: Any, cache: Any, q_lens: Any = None, rows: Any = None,
                positions: Any = None, keep: Any = None
                ) -> tuple[list, tuple[tuple[int, ...], tuple[int, ...], list[int]]]:
        """Graph inputs for block input ``x`` (see the module docstring; ``rows``: the
        cache row of each batch row, default ``0..B-1``; ``positions``: each token's
        RoPE position, default its cache slot; ``keep``: the tokens (packed indices)
        a LastToken keeps, default each row's last; all checked against the cache:
        nothing is written when this raises) and ``(rows, tokens per row, layers)``."""
        if q_lens is None and rows is None and keep is None:
            fast = self._prepare_steady(x, cache, positions)
            if fast is not None:
                return fast
        name = self.graph.name
        shape = tuple(x.shape)
        if q_lens is None:
            if len(shape) < 2:
                raise ShapeError(name, "block input with an atb.KVCache", "[B, S, ...]",
                                 list(shape))
            b, s = int(shape[0]), int(shape[1])
            if not 1 <= b <= cache.max_batch:
                raise InputError(name, "batch rows with an atb.KVCache",
                                 f"1..{cache.max_batch} (the cache's max_batch)", b)
            q = (s,) * b
        else:
            q = _q_lens(name, q_lens, shape, cache.max_batch)
            b = len(q)
        rows = _rows(name, rows, b, cache.max_batch)
        views, index = cache_state(cache)
        layers = self.layers._layers(cache)
        pairs = self._pairs(x, cache, views, layers)
        p = self._past(cache, rows, layers)
        top = int((p + np.asarray(q)).max())
        if top > cache.max_seq_len:
            raise ShapeError(name, "tokens in the atb.KVCache after this call",
                             f"<= max_seq_len {cache.max_seq_len}", top)
        pos = _ints(name, "positions", positions, sum(q), 0, None)
        kept = _ints(name, "keep", keep, None, 0, sum(q))
        key = (framework_of(x), str(getattr(x, "device", "cpu")), cache.max_seq_len, q, rows)
        got = index.get(key)
        if got is None:
            if len(index) >= _MAX_INDEX_SETS:  # a server's many prompt lengths: oldest out
                index.pop(next(iter(index)))
            got = index[key] = _IndexSet(x, cache.max_seq_len, q, p, rows)
        idx = got.at(p, pos)
        xt = x if q_lens is not None else x.reshape([sum(q), *shape[2:]])
        inputs = self._assemble(idx, pairs, xt)
        if kept is not None:
            if LAST_ROWS not in self.index:
                raise InputError(name, "keep", "a graph ending in a LastToken", "keep=")
            inputs[self.graph.inputs.index(LAST_ROWS)] = _on(*got.where, kept)
            self.raw = None
        span = _span(layers)
        self._steady = None
        if q_lens is None and kept is None and rows == tuple(range(b)) and span is not None:
            self._steady = (cache, getattr(cache, "version", 0), shape, got,
                            slice(span.start, span.stop), pairs, (rows, q, layers))
        return inputs, (rows, q, layers)

    def _prepare_steady(self, x: Any, cache: Any, positions: Any) -> tuple | None:
        """:meth:`prepare` for the same cache, rows and shape as the last plain call
        (a decode loop's steps): only the lengths (equal across the layers, room left)
        and the positions are checked again. None: the general path decides."""
        st = self._steady
        if st is None or st[0] is not cache or st[1] != getattr(cache, "version", 0) \
                or st[2] != tuple(x.shape) or getattr(cache, "freed", False):
            return None
        _, _, shape, got, layers, pairs, info = st
        b, s = shape[0], shape[1]
        lens = cache.lens_view(layers, b)
        rows = lens.tolist()  # (a few ints: list compares beat NumPy reductions here)
        if rows.count(rows[0]) != len(rows) or max(rows[0]) + s > cache.max_seq_len:
            return None
        p = lens[0]
        pos = None
        if positions is not None:
            pos = np.asarray(positions).reshape(-1)
            if pos.size != b * s or pos.dtype.kind not in "iu" or int(pos.min()) < 0:
                return None
        seen, xt = self._x_view
        if seen is not x:
            xt = x.reshape([b * s, *shape[2:]])
            self._x_view = (x, xt)
        return self._assemble(got.at(p, pos), pairs, xt, True), info

    def _assemble(self, idx: list, pairs: list, xt: Any, steady: bool = False) -> list:
        """The graph inputs: index tensors ``idx`` (slots, tables, context lengths,
        new-token lengths, positions, last rows), the layers' caches ``pairs`` and
        the token-major block input ``xt``; sets :attr:`raw`. ``steady``: a steady
        step's (:meth:`_prepare_steady`), remembered for the next one."""
        last = self._last
        if last is not None and last[0] is idx and last[1] is pairs and last[2] is xt:
            # a decode loop's step: the very lists and block input of the last call (the
            # index set's own tensor list, the steady pairs, the caller's buffer's view)
            self.raw = last[4]
            return list(last[3])
        tkey = (id(idx[0]), *map(id, (t for kv in pairs for t in kv)))
        tpl = self._template
        if tpl is None or tpl[0] != tkey:  # the inputs but x, while the same tensors serve
            feed = dict(zip(self.index, idx[:4] + (idx[5:] if LAST_ROWS in self.index else [])))
            for slot, kv in zip(self.slots, pairs):
                if bool(slot.key_scale) != (len(kv) == 4):
                    raise DtypeError(self.graph.name, "atb.KVCache dtype (the cache the "
                                     "block was lowered for)", "int8" if slot.key_scale
                                     else "a float dtype", "int8" if len(kv) == 4
                                     else "a float dtype")
                feed[slot.key_cache], feed[slot.value_cache] = kv[:2]
                if slot.key_scale:
                    feed[slot.key_scale], feed[slot.value_scale] = kv[2:]
                if slot.position_ids:
                    feed[slot.position_ids] = idx[4]
            feed[BLOCK_INPUT] = None
            ins = [feed[i] for i in self.graph.inputs]
            sig = raw_signature([t for t in ins if t is not None]) or ()
            # the signature of every input but x, read once per set of tensors
            tpl = self._template = (tkey, ins, sig[:self._x_at], sig[self._x_at:])
        inputs = list(tpl[1])
        inputs[self._x_at] = xt
        xs = raw_signature([xt])
        self.raw = None if xs is None or not tpl[2] + tpl[3] else tpl[2] + xs + tpl[3]
        if steady:  # (xt is held by _x_view already: nothing more is kept alive)
            self._last = (idx, pairs, xt, inputs, self.raw)
        return list(inputs) if steady else inputs

    def prepare_paged(self, x: Any, cache: Any, batch: Any, all_logits: bool = False) -> list:
        """Graph inputs for the packed new tokens ``x`` ``[T, ...]`` of the sequences of
        ``batch`` (a :class:`~atbcore.memory.paged.PagedBatch` of ``cache``, a
        ``PagedKVCache``: see the module docstring and :mod:`.graph_op_paged`);
        checked against both first (nothing is written when this raises).
        ``all_logits``: the graph's last-token gather keeps every token (``[T, ...]``
        out) instead of each sequence's last."""
        from .graph_op_paged import paged_index

        idx = paged_index(self.graph.name, x, cache, batch, all_logits)
        views, _ = cache_state(cache)
        pairs = self._pairs(x, cache, views, self.layers._layers(cache))
        return self._assemble(idx, pairs, x)

    def finish(self, out: Any, cache: Any,
               shape: tuple[tuple[int, ...], tuple[int, ...], list[int]],
               packed: bool = False, raw: bool = False) -> Any:
        """Count the written tokens; the block output back as ``[B, S, ...]`` (``[B, 1,
        ...]`` when the graph keeps each row's last token; packed ``[T, ...]`` as it
        came when the tokens were given packed; ``raw``: as the plan returned it)."""
        rows, q, layers = shape
        st = self._steady
        if st is not None and st[6] is shape and st[0] is cache:  # checked in prepare
            cache.lens_view(st[4], len(rows))[...] += q[0]
            if raw:
                return out
            return reshape(out, [len(rows), 1, -1]) if int(out.shape[0]) == len(rows) \
                and q[0] != 1 else reshape(out, [len(rows), q[0], -1])
        b, span = len(rows), _span(layers)
        for n in sorted(set(q)):
            these = [r for r, m in zip(rows, q) if m == n]
            these = range(b) if these == list(range(b)) else these
            for layer in ([span] if span is not None else layers):
                cache.advance(layer, n, these)
        if raw:
            return out
        if int(out.shape[0]) == b and (packed or sum(q) != b):
            return reshape(out, [b, 1, -1])                 # one (last) token per row
        if packed:
            return out
        return reshape(out, [b, q[0], -1])
