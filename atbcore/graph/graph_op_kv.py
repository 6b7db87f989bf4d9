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
  that cache on first use (layers called in model order get 0, 1, ...); the past is
  read from it and the new keys/values are appended in place; the same cache is
  returned. All sequences of the batch must hold the same number of tokens.
* a list of ``(past_key, past_value)`` pairs, one per attention layer of the block
  (a single pair may be given bare): the presents come back as a list of pairs.

Positions for RoPE are ``P, P+1, ..., P+S-1``.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import numpy as np

from ..dtypes import Dtype
from ..errors import InputError
from ..tensor import TensorDesc, convert, describe, framework_of
from .ir import Graph
from .sequential import KVSlot, kv_cache_slots

__all__ = ["KVBinder", "kv_dim_names"]

# cache object -> {GraphOp key: [layer index per slot]}
_CACHE_LAYERS: "weakref.WeakKeyDictionary[Any, dict[str, list[int]]]" = \
    weakref.WeakKeyDictionary()


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
    t = convert(arr, framework_of(x))
    dev = getattr(x, "device", None)
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


def _bare_pair(kv: Any) -> bool:
    items = list(kv)
    return len(items) == 2 and not isinstance(items[0], (list, tuple))


def _as(x: Any, t: Any) -> Any:
    """A cache tensor as ``x``'s framework (zero-copy where possible)."""
    return convert(t, framework_of(x))
