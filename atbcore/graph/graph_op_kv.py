"""KV caches for ``GraphOp.__call__(x, kv_cache=...)``.

A sequential block with ``FlashAttention(kv_cache=True)`` lowers to a graph with,
per attention layer, inputs ``<layer>.past_key`` / ``<layer>.past_value``
``[B, P, Hkv*D]`` (and ``<layer>.position_ids`` ``[S]`` with RoPE) and outputs
``<layer>.present_key`` / ``<layer>.present_value`` ``[B, P+S, Hkv*D]``
(:func:`atbcore.graph.sequential.kv_cache_slots`). ``kv_cache=`` may be:

* ``None`` or a ``dict``: a functional cache. Each GraphOp keeps its own entry (keyed
  by the GraphOp), so the seed's loop ``x, kv = layer(x, kv_cache=kv)`` over many
  layers sharing one ``kv`` works; ``None`` starts empty and a dict is returned.
* an ``atbcore.memory.KVCache``: each GraphOp takes the next free layer indices of
  that cache on first use (layers called in model order get 0, 1, ...); the same
  cache is returned. All sequences of the batch must hold the same number of tokens.
  A block built from layers runs in the in-place cache form
  (:func:`atbcore.graph.sequential.lower_sequential` with ``kv_cache_desc``, fed by
  :class:`CacheFeeder`): the new keys/values are written into the cache layer by the
  plan itself and attention reads the cache where it is, so a decode step has the
  same input shapes as the previous one and reuses its bound program. A block given
  as a Graph reads the past from the cache, concatenates, and appends the new part.
* a list of ``(past_key, past_value)`` pairs, one per attention layer of the block
  (a single pair may be given bare): the presents come back as a list of pairs.

Positions for RoPE are ``P, P+1, ..., P+S-1``.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Sequence

import numpy as np

from ..dtypes import Dtype
from ..errors import DtypeError, InputError, ShapeError
from ..tensor import TensorDesc, convert, describe, framework_of
from .ir import Graph
from .sequential import BLOCK_INPUT, KVSlot, kv_cache_slots

__all__ = ["KVBinder", "kv_dim_names", "CacheFeeder", "in_place_cache", "in_place_form",
           "run_in_place", "cache_layers", "share_cache_layers"]

# cache object -> {GraphOp key: [layer index per slot]}
_CACHE_LAYERS: "weakref.WeakKeyDictionary[Any, dict[str, list[int]]]" = \
    weakref.WeakKeyDictionary()
# cache object -> ({(framework, layer): (keys, values) views}, {shape key: _IndexSet}):
# every block of a step, and every step, reads the same tensors (bound programs pack
# their addresses once)
_CACHE_STATE: "weakref.WeakKeyDictionary[Any, tuple[dict, dict]]" = weakref.WeakKeyDictionary()


class _IndexSet:
    """The in-place form's index tensors for one (framework, device, B, S): NumPy
    arrays and the framework's tensors of them. Where those share memory (NumPy,
    torch on the CPU) a new past length is written into them in place."""

    def __init__(self, x: Any, cap: int, b: int, s: int, p: int) -> None:
        rows = np.arange(b, dtype=np.int64)
        tok = np.arange(p, p + s, dtype=np.int64)
        self.arrays = [(rows[:, None] * cap + tok[None]).reshape(-1).astype(np.int32),
                       rows[:, None].astype(np.int32), np.full(b, p + s, dtype=np.int32),
                       np.full(b, s, dtype=np.int32), np.tile(tok, b)]
        self.p, self.where = p, (framework_of(x), getattr(x, "device", None))
        self.tensors = [_on(*self.where, a) for a in self.arrays]
        self.shared = all(_shares(t, a) for t, a in zip(self.tensors, self.arrays))

    def at(self, p: int) -> list:
        if p != self.p:
            delta, self.p = p - self.p, p
            for i in (0, 2, 4):  # slots, context lengths, positions move with the past
                self.arrays[i] += delta
            if not self.shared:
                self.tensors = [_on(*self.where, a) for a in self.arrays]
        return self.tensors


def _shares(t: Any, a: np.ndarray) -> bool:
    if t is a:
        return True
    ptr = getattr(t, "data_ptr", None)
    return ptr is not None and getattr(t, "device", None) is not None and \
        str(t.device) == "cpu" and ptr() == a.ctypes.data


def _index_tensors(index: dict, x: Any, fw: str, cap: int, b: int, s: int, p: int) -> list:
    """slot_mapping, block_tables, context_lens, q_seq_lens (int32) and the RoPE
    positions (int64 ``[B*S]``) for past length ``p``."""
    key = (fw, str(getattr(x, "device", "cpu")), cap, b, s)
    got = index.get(key)
    if got is None:
        got = index[key] = _IndexSet(x, cap, b, s, p)
    return got.at(p)


def cache_layers(op: Any, cache: Any) -> list[int] | None:
    """The layers of ``cache`` GraphOp ``op``'s attention layers use (None before it
    first ran with that cache)."""
    kv = op._kv
    table = _CACHE_LAYERS.get(cache)
    return None if kv is None or table is None else table.get(kv.key)


def share_cache_layers(op: Any, cache: Any, layers: Sequence[int]) -> None:
    """Make GraphOp ``op`` (lowered) read and write ``cache`` layers ``layers``, one per
    attention layer in order, though other GraphOps use them too (a whole-model
    program over the cache its per-block GraphOps filled)."""
    kv = op._kv
    layers = [int(i) for i in layers]
    if kv is None or len(layers) != len(kv.slots) or \
            any(not 0 <= i < cache.num_layers for i in layers):
        raise InputError(op.name, "KVCache layers to share",
                         f"{len(kv.slots) if kv else 0} layer indices below {cache.num_layers}",
                         layers)
    _CACHE_LAYERS.setdefault(cache, {})[kv.key] = layers


def in_place_cache(kv_cache: Any) -> bool:
    """A contiguous cache the in-place form can write (``atbcore.memory.KVCache``)."""
    return all(hasattr(kv_cache, a) for a in ("keys", "values", "advance", "seq_lens",
                                              "max_seq_len", "max_batch"))


def kv_dim_names(graph: Graph) -> dict[str, tuple[str | None, ...]]:
    """Dim names of the cache inputs for the plan cache (past length is ``kv_len``)."""
    out: dict[str, tuple[str | None, ...]] = {}
    for s in kv_cache_slots(graph):
        out[s.past_key] = out[s.past_value] = ("batch_size", "kv_len", None)
        if s.position_ids:
            out[s.position_ids] = ("seq_len",)
    return out


def _like(x: Any, arr: np.ndarray) -> Any:
    """``arr`` as a tensor of ``x``'s framework on ``x``'s device."""
    return _on(framework_of(x), getattr(x, "device", None), arr)


def _on(framework: str, dev: Any, arr: np.ndarray) -> Any:
    """``arr`` as a ``framework`` tensor on device ``dev`` (None: the default)."""
    t = convert(arr, framework)
    if dev is not None and hasattr(t, "to") and str(getattr(t, "device", "cpu")) != str(dev):
        t = t.to(dev)
    return t


class KVBinder:
    """Feeds a graph's cache inputs from ``kv_cache`` and stores its presents back."""

    def __init__(self, graph: Graph, key: str) -> None:
        self.graph = graph
        self.key = key
        self.slots: list[KVSlot] = kv_cache_slots(graph)
        cache_ids = {s.past_key for s in self.slots} | {s.past_value for s in self.slots} | \
            {s.position_ids for s in self.slots if s.position_ids}
        self.user_inputs = [i for i in graph.inputs if i not in cache_ids]
        self.descs = graph.desc_map

    def _hidden(self, slot: KVSlot) -> int:
        d = self.descs.get(slot.past_key)
        if d is None:
            raise InputError(self.graph.name, f"descriptor of {slot.past_key!r}",
                             "known from lowering", "none")
        return d.shape[-1]

    def _pasts(self, x: Any, kv_cache: Any) -> list[tuple[Any, Any]] | None:
        """Past (k, v) per slot, or None where the past is empty."""
        n = len(self.slots)
        if kv_cache is None:
            return [None] * n
        if isinstance(kv_cache, dict):
            got = kv_cache.get(self.key)
            return list(got) if got is not None else [None] * n
        if hasattr(kv_cache, "seq_lens") and hasattr(kv_cache, "get"):
            return self._from_cache(x, kv_cache)
        pairs = list(kv_cache)
        if n == 1 and len(pairs) == 2 and not isinstance(pairs[0], (list, tuple)):
            pairs = [tuple(pairs)]
        if len(pairs) != n or any(len(p) != 2 for p in pairs):
            raise InputError(self.graph.name, "kv_cache pairs",
                             f"{n} (past_key, past_value) pair(s)", f"{len(pairs)} item(s)")
        return [tuple(p) for p in pairs]

    def _layers(self, cache: Any) -> list[int]:
        table = _CACHE_LAYERS.setdefault(cache, {})
        if self.key not in table:
            start = sum(len(v) for v in table.values())
            if start + len(self.slots) > cache.num_layers:
                raise InputError(self.graph.name, "KVCache layers",
                                 f"a free layer (cache has {cache.num_layers})",
                                 f"{start + len(self.slots)} attention layers using it")
            table[self.key] = list(range(start, start + len(self.slots)))
        return table[self.key]

    def _from_cache(self, x: Any, cache: Any) -> list[Any]:
        b = describe(x).shape[0]
        out = []
        for slot, layer in zip(self.slots, self._layers(cache)):
            lens = np.asarray(cache.seq_lens(list(range(b)), layer))
            if len(set(lens.tolist())) > 1:
                raise InputError(self.graph.name, f"KVCache layer {layer} lengths",
                                 "equal lengths for every sequence", lens.tolist())
            p = int(lens[0]) if len(lens) else 0
            if p == 0:
                out.append(None)
                continue
            k, v, _ = cache.get(layer, list(range(b)))
            hd = self._hidden(slot)
            # [B, P, Hkv, D] views of the cache -> [B, P, Hkv*D]
            out.append((_as(x, k[:, :p].reshape(b, p, hd)), _as(x, v[:, :p].reshape(b, p, hd))))
        return out

    def empty_past_descs(self, user: Sequence[TensorDesc]) -> list[TensorDesc]:
        """Full input descriptors for the user's, with an empty past."""
        feed = dict(zip(self.user_inputs, user))
        b, s = user[0].shape[0], user[0].shape[1]
        for slot in self.slots:
            past = TensorDesc((b, 0, self._hidden(slot)), user[0].dtype, device=user[0].device)
            feed[slot.past_key] = feed[slot.past_value] = past
            if slot.position_ids:
                feed[slot.position_ids] = TensorDesc((s,), Dtype.INT64, device=user[0].device)
        return [feed[i] for i in self.graph.inputs]

    # ------------------------------------------------------------------ a call
    def inputs(self, user: Sequence[Any], kv_cache: Any) -> tuple[list, list[int]]:
        """Full graph inputs for the user's tensors, and the past length per slot."""
        if len(user) != len(self.user_inputs):
            raise InputError(self.graph.name, "number of inputs",
                             f"{len(self.user_inputs)} ({', '.join(self.user_inputs)})", len(user))
        x = user[0]
        dx = describe(x)
        pasts = self._pasts(x, kv_cache)
        feed = dict(zip(self.user_inputs, user))
        plens = []
        for slot, past in zip(self.slots, pasts):
            if past is None:
                empty = np.zeros((dx.shape[0], 0, self._hidden(slot)), dtype=dx.dtype.numpy)
                past = (_like(x, empty), _like(x, empty))
            feed[slot.past_key], feed[slot.past_value] = past
            p = describe(past[0]).shape[1]
            plens.append(p)
            if slot.position_ids:
                feed[slot.position_ids] = _like(x, np.arange(p, p + dx.shape[1], dtype=np.int64))
        return [feed[i] for i in self.graph.inputs], plens

    def store(self, outputs: list, kv_cache: Any, plens: list[int]) -> Any:
        """Save the presents into ``kv_cache``; returns what the caller gets back."""
        pos = {o: i for i, o in enumerate(self.graph.outputs)}
        presents = [(outputs[pos[s.present_key]], outputs[pos[s.present_value]])
                    for s in self.slots]
        if kv_cache is None or isinstance(kv_cache, dict):
            state = {} if kv_cache is None else kv_cache
            state[self.key] = presents
            return state
        if hasattr(kv_cache, "seq_lens") and hasattr(kv_cache, "append"):
            for (k, v), p, layer in zip(presents, plens, self._layers(kv_cache)):
                kv_cache.append(layer, k[:, p:], v[:, p:])
            return kv_cache
        return presents if len(presents) > 1 or not _bare_pair(kv_cache) else presents[0]


class CacheFeeder:
    """Feeds an in-place cache form graph (see the module docstring) from a
    ``KVCache`` and counts the tokens its plan wrote. ``layers`` assigns the
    cache's layer indices (the block's concatenating-form :class:`KVBinder`, so both
    forms of one block use the same layers)."""

    def __init__(self, graph: Graph, layers: KVBinder) -> None:
        from .sequential import CACHE_INDEX, cache_slots

        self.graph, self.layers = graph, layers
        self.slots = cache_slots(graph)
        self.index = CACHE_INDEX
        self._x_at = graph.inputs.index(BLOCK_INPUT)
        # (ids of the tensors, the graph inputs with x left out, the tensors kept alive)
        self._template: tuple | None = None
        if len(self.slots) != len(layers.slots):
            raise InputError(graph.name, "attention layers with a KV cache", len(layers.slots),
                             len(self.slots))

    def prepare(self, x: Any, cache: Any) -> tuple[list, tuple[int, int, list[int]]]:
        """Graph inputs for block input ``x`` ``[B, S, ...]`` (checked against
        the cache: nothing is written when this raises) and ``(B, S, layers)``."""
        name = self.graph.name
        shape = tuple(x.shape)
        if len(shape) < 2:
            raise ShapeError(name, "block input with an atb.KVCache", "[B, S, ...]",
                             list(shape))
        b, s = int(shape[0]), int(shape[1])
        if not 1 <= b <= cache.max_batch:
            raise InputError(name, "batch rows with an atb.KVCache",
                             f"1..{cache.max_batch} (the cache's max_batch)", b)
        state = _CACHE_STATE.get(cache)
        if state is None:
            state = _CACHE_STATE[cache] = ({}, {})
        views, index = state
        fw = framework_of(x)
        layers = self.layers._layers(cache)
        pairs = [views.get((fw, layer)) for layer in layers]
        if getattr(cache, "freed", False) or None in pairs:
            want = describe(x).dtype  # token ids: the cache write's own dtype check runs
            if want.is_floating and Dtype.of(cache.dtype) != want:
                raise DtypeError(name, "atb.KVCache dtype (the block input's)", want.name,
                                 Dtype.of(cache.dtype).name)
            pairs = [(_as(x, cache.keys(layer)), _as(x, cache.values(layer))) for layer in layers]
            views.update(((fw, layer), kv) for layer, kv in zip(layers, pairs))
        span = _span(layers)
        lens = cache.seq_lens(range(b), span) if span is not None else \
            np.stack([cache.seq_lens(range(b), layer) for layer in layers])
        p = int(lens.flat[0])
        if (lens != p).any():
            layer = layers[int(np.argwhere(lens != p)[0][0])]
            raise InputError(name, f"KVCache layer {layer} lengths",
                             f"equal lengths for every sequence (the block's first layer "
                             f"holds {p})", lens.tolist())
        if p + s > cache.max_seq_len:
            raise ShapeError(name, "tokens in the atb.KVCache after this call",
                             f"<= max_seq_len {cache.max_seq_len}", p + s)
        idx = _index_tensors(index, x, fw, cache.max_seq_len, b, s, p)
        key = (id(idx[0]), *map(id, (t for kv in pairs for t in kv)))
        tpl = self._template
        if tpl is None or tpl[0] != key:  # the inputs but x, while the same tensors serve
            feed = dict(zip(self.index, idx[:4]))
            for slot, (k, v) in zip(self.slots, pairs):
                feed[slot.key_cache], feed[slot.value_cache] = k, v
                if slot.position_ids:
                    feed[slot.position_ids] = idx[4]
            feed[BLOCK_INPUT] = None
            tpl = self._template = (key, [feed[i] for i in self.graph.inputs], pairs, idx)
        inputs = list(tpl[1])
        inputs[self._x_at] = x.reshape([b * s, *shape[2:]])
        return inputs, (b, s, layers)

    def finish(self, out: Any, cache: Any, shape: tuple[int, int, list[int]]) -> Any:
        """Count the written tokens; the block output back as ``[B, S, hidden]``."""
        b, s, layers = shape
        span = _span(layers)
        for layer in ([span] if span is not None else layers):
            cache.advance(layer, s, range(b))
        # [B*S, ...] per token, or [B, ...] when the graph keeps each row's last token
        return out.reshape([b, s if out.shape[0] == b * s else 1, -1])


def _span(layers: list[int]) -> range | None:
    """Consecutive cache layers as one range (read and counted in one call)."""
    if layers and layers[-1] - layers[0] == len(layers) - 1:
        return range(layers[0], layers[-1] + 1)
    return None


def in_place_form(op: Any, x: Any, cache: Any) -> Any:
    """``op``'s in-place cache form: a GraphOp of the same class sharing its layers,
    settings, plugins and bound weights, lowered token-major for ``cache``'s layer
    shape (made on first use, under the op's lock). None when the block cannot take
    it: given as a Graph, or with an attention layer that keeps no cache."""
    form = op._in_place
    if form is not None:  # made (or refused) once
        return form or None
    with op._lock:
        form = op._in_place
        if form is None:
            from .layers_block import flat_layers

            layers = None if op._layers is None else flat_layers(op._layers)
            if layers is None or any(getattr(l, "kind", "") == "attention" and
                                     not getattr(l, "kv_cache", False) for l in layers):
                op._in_place = False
                return None
            form = copy.copy(op)
            form._reset_state()
            form.graph_unfused = None
            dx, dc = describe(x), describe(_as(x, cache.keys(0)))
            form._cache_form = (dc, dx.shape[0])
            form._ensure_graph([dx.replace(shape=(dx.shape[0] * dx.shape[1], *dx.shape[2:]))])
            form._feeder = feeder = CacheFeeder(form.graph, op._kv)
            # the caches and their index tensors come from the feeder, checked there
            form._trusted = frozenset(feeder.index) | {
                t for s in feeder.slots for t in (s.key_cache, s.value_cache, s.position_ids)
                if t}
            op._in_place = form
        return form or None


def run_in_place(op: Any, x: Any, cache: Any) -> Any:
    """Run block ``op`` on ``x`` ``[B, S, ...]`` (hidden states, or token ids when the
    block starts with an embedding) with ``cache`` in the in-place cache form; None
    when the block cannot take it (the caller concatenates)."""
    if x is None or getattr(x, "ndim", 0) < 2:
        return None
    form = in_place_form(op, x, cache)
    if form is None:
        return None
    inputs, shape = form._feeder.prepare(x, cache)
    out = form.execute(inputs)[0]
    return form._feeder.finish(out, cache, shape)


def _bare_pair(kv: Any) -> bool:
    items = list(kv)
    return len(items) == 2 and not isinstance(items[0], (list, tuple))


def _as(x: Any, t: Any) -> Any:
    """A cache tensor as ``x``'s framework (zero-copy where possible)."""
    return convert(t, framework_of(x))
