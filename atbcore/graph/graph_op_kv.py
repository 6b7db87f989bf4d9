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
  cache is returned. Rows may hold different numbers of tokens (in the in-place
  form below each continues from its own past).
  A block built from layers runs in the in-place cache form
  (:func:`atbcore.graph.sequential.lower_sequential` with ``kv_cache_desc``, fed by
  :class:`~atbcore.graph.graph_op_feed.CacheFeeder`): the new keys/values are written into the cache layer by the
  plan itself and attention reads the cache where it is, so a decode step has the
  same input shapes as the previous one and reuses its bound program. A block given
  as a Graph reads the past from the cache, concatenates, and appends the new part
  (its rows must then hold equal lengths).
* a list of ``(past_key, past_value)`` pairs, one per attention layer of the block
  (a single pair may be given bare): the presents come back as a list of pairs.

Positions for RoPE are ``P, P+1, ..., P+S-1`` (``P`` per row).
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Sequence

import numpy as np

from ..dtypes import Dtype
from ..errors import InputError
from ..tensor import TensorDesc, describe, framework_of
from .ir import Graph
from .graph_op_feed import CacheFeeder, _as, _on, layer_kv
from .sequential import KVSlot, kv_cache_slots

__all__ = ["KVBinder", "kv_dim_names", "CacheFeeder", "in_place_cache", "in_place_form",
           "run_in_place", "run_paged", "cache_layers", "share_cache_layers"]

# cache object -> {GraphOp key: [layer index per slot]}
_CACHE_LAYERS: "weakref.WeakKeyDictionary[Any, dict[str, list[int]]]" = \
    weakref.WeakKeyDictionary()
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
            dx, dc = describe(x), describe(_as(x, layer_kv(cache, 0)[0]))
            form._cache_form = (dc, dx.shape[0])
            form._ensure_graph([dx.replace(shape=(dx.shape[0] * dx.shape[1], *dx.shape[2:]))])
            form._feeder = feeder = CacheFeeder(form.graph, op._kv)
            # the caches and their index tensors come from the feeder, checked there
            form._trusted = frozenset(feeder.index) | {
                t for s in feeder.slots for t in (s.key_cache, s.value_cache, s.position_ids,
                                                  s.key_scale, s.value_scale) if t}
            op._in_place = form
        return form or None


def run_in_place(op: Any, x: Any, cache: Any, q_lens: Any = None, rows: Any = None,
                 positions: Any = None, keep: Any = None, raw: bool = False) -> Any:
    """Run block ``op`` on ``x`` ``[B, S, ...]`` (hidden states, or token ids when the
    block starts with an embedding) with ``cache`` in the in-place cache form; None
    when the block cannot take it (the caller concatenates). With ``q_lens`` (tokens
    per row) ``x`` is packed ``[T, ...]``: rows of different lengths; ``rows``: the
    cache row of each batch row; ``positions``: the tokens' RoPE positions (default:
    their cache slots); ``keep``: the tokens a LastToken keeps (packed indices; the
    output is then ``[len(keep), ...]``); ``raw``: the output as the plan gives it
    (token-major, or one row per sequence after a LastToken), in the plan's own buffer
    that the next raw run overwrites (:mod:`.graph_op_feed`)."""
    if x is None or getattr(x, "ndim", 0) < (1 if q_lens is not None else 2):
        return None
    x3 = x if q_lens is None else x[None]
    if op.graph is None:  # the block's own lowering first (its cache layer assignment)
        op._ensure_graph(op._descs_of([x3]))
    form = in_place_form(op, x3, cache)
    if form is None:
        return None
    feeder = form._feeder
    inputs, shape = feeder.prepare(x, cache, q_lens, rows, positions, keep)
    hot = form._run_hot(inputs, feeder.raw, raw) if feeder.raw is not None else None
    out = (hot if hot is not None else form.execute(inputs))[0]
    return form._feeder.finish(out, cache, shape, packed=q_lens is not None, raw=raw)


def run_paged(op: Any, x: Any, cache: Any, batch: Any, all_logits: bool = False) -> Any:
    """Run block ``op`` (built from layers, e.g. :func:`atbcore.models.decoder.decoder_layers`
    with ``last_token=True``) on the packed new tokens ``x`` ``[T]`` (ids; ``[T, H]``
    hidden states) of the sequences of ``batch``, a
    :class:`~atbcore.memory.paged.PagedBatch` of the paged ``cache``: the plan writes
    their keys/values at the batch's slots and attends over its block tables. Returns
    ``[B, ...]``: each sequence's last new token (``[T, ...]``: every token with
    ``all_logits``, or when the block keeps every token). The block manager counts the
    tokens (``cache.prepare_*``), not this."""
    if x is None or getattr(x, "ndim", 0) < 1:
        raise InputError(op.name, "packed new tokens of a PagedBatch", "[T] ids or [T, H]",
                         getattr(x, "shape", None))
    form = op._in_place or None  # made on the first call: no [1, T] view of x after it
    if form is None:  # (in MindSpore that view is an op the next C call waits for)
        x3 = x[None]
        if op.graph is None:  # the block's own lowering first (its cache layer assignment)
            op._ensure_graph(op._descs_of([x3]))
        form = in_place_form(op, x3, cache)
    if form is None:
        raise InputError(op.name, "block run over a PagedKVCache", "layers with "
                         "FlashAttention(kv_cache=True)", "a block without the in-place form")
    feeder = form._feeder
    inputs = feeder.prepare_paged(x, cache, batch, all_logits)
    hot = form._run_hot(inputs, feeder.raw) if feeder.raw is not None else None
    return (hot if hot is not None else form.execute(inputs))[0]


def _bare_pair(kv: Any) -> bool:
    items = list(kv)
    return len(items) == 2 and not isinstance(items[0], (list, tuple))
