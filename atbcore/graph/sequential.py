"""Lowering a sequential list of layers (``GraphOp([...])``) to the graph IR.

    g = lower_sequential([LayerNorm(eps=1e-5), Linear(out_features=3 * H),
                          FlashAttention(num_heads=4, causal=True),
                          Linear(out_features=H), ResidualAdd()],
                         [TensorDesc([2, 16, H])], name="attn")

Graph interface:

* inputs: ``"input"`` (the block input x, the first argument of the call), then for
  every ``FlashAttention(kv_cache=True)`` its ``<name>.past_key``,
  ``<name>.past_value`` (and ``<name>.position_ids`` with a RoPE layer), in layer
  order (:func:`kv_cache_slots` lists them);
* outputs: the last layer's output, then every ``<name>.present_key`` /
  ``<name>.present_value``.

**In-place cache form** (``kv_cache_desc=`` given: a contiguous cache layer
``[max_batch, max_seq_len, Hkv, D]``, e.g. ``atbcore.memory.KVCache.keys(layer)``).
The block is lowered token-major: ``"input"`` is ``[T, hidden]`` (the ``B * S``
tokens of equal-length rows, row-major), and every ``FlashAttention(kv_cache=True)``
writes its new keys/values into its cache layer with ``ReshapeAndCache`` and attends
with ``PagedAttention`` over it (the cache read as ``max_batch`` blocks of
``max_seq_len`` rows): nothing is concatenated and the graph's input shapes do not
change from one decode step to the next. Inputs: ``"input"``, per attention
``<name>.key_cache`` / ``<name>.value_cache`` (and ``<name>.position_ids`` ``[T]``
with RoPE), and once per block the int32 index tensors of :data:`CACHE_INDEX`
(``slot_mapping [T]``, ``block_tables [B, 1]``, ``context_lens [B]``,
``q_seq_lens [B]``). An int8 cache layer (``kv_cache_desc`` dtype int8) adds per
attention ``<name>.key_scale`` / ``<name>.value_scale`` ``[max_batch, max_seq_len,
Hkv]`` fp16 after its caches, and the write and read are ``ReshapeAndCacheInt8`` /
``PagedAttentionInt8``. Outputs: the last layer's ``[T, hidden]``; the caches are
written in place. :func:`cache_slots` lists the attention layers.

Descriptors: ``input_descs[0]`` describes x. The following ones describe the
cache inputs in the order above; when only x is given they default to an empty
past ``[B, 0, Hkv*D]`` (and positions ``[S]``).

**Extra positional arguments.** The seed article calls its attention block as
``attention_block(query, key, value, residual)``. A sequential block reads only
its first input: self-attention derives q, k and v from x, and ``ResidualAdd``
adds the block input (or a named layer's output). So descriptors beyond the ones
above become graph inputs ``unused_1``, ``unused_2``, ... that no node reads, and a
``UserWarning`` says they are ignored — the call works as written, and nothing is
silently interpreted as something it may not be.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Sequence

from ..dtypes import Dtype
from ..errors import GraphError, InputError, ParamsError
from ..tensor import TensorDesc
from .builder import GraphBuilder
from .ir import Graph
from .layers import Layer

__all__ = ["lower_sequential", "LoweringContext", "KVSlot", "kv_cache_slots", "BLOCK_INPUT",
           "CacheSlot", "cache_slots", "CACHE_INDEX"]

BLOCK_INPUT = "input"
# the in-place cache form's index inputs, shared by the block's attention layers
CACHE_INDEX = ("cache.slot_mapping", "cache.block_tables", "cache.context_lens",
               "cache.q_seq_lens")


@dataclass(frozen=True)
class KVSlot:
    """The cache tensors of one ``FlashAttention(kv_cache=True)`` layer."""

    layer: str
    past_key: str
    past_value: str
    present_key: str
    present_value: str
    position_ids: str | None = None


@dataclass(frozen=True)
class CacheSlot:
    """The cache inputs of one attention layer in the in-place cache form (with an
    int8 cache, its scale caches too)."""

    layer: str
    key_cache: str
    value_cache: str
    position_ids: str | None = None
    key_scale: str | None = None
    value_scale: str | None = None


class LoweringContext:
    """State shared by the layers while one list is lowered. ``cache_desc``: the
    in-place cache form's cache layer descriptor (None = the concatenating form)."""

    def __init__(self, builder: GraphBuilder, input_id: str, layers: Sequence[Layer],
                 extra_descs: Sequence[TensorDesc], cache_desc: TensorDesc | None = None,
                 batch: int = 1) -> None:
        self.builder = builder
        self.cache_desc, self.batch = cache_desc, int(batch)
        self.cache_slots: list[CacheSlot] = []
        self.input = input_id
        self.layers = list(layers)
        self.index = 0
        self.pending_rope: Any = None
        self.kv_slots: list[KVSlot] = []
        self.extra_outputs: list[str] = []
        self._extra = list(extra_descs)
        self._names: dict[int, str] = {}
        self._outputs: dict[str, str] = {}
        self._reserved = {l.name for l in layers if l.name}

    @property
    def prev_layer(self) -> Layer | None:
        return self.layers[self.index - 1] if self.index > 0 else None

    @property
    def next_layer(self) -> Layer | None:
        return self.layers[self.index + 1] if self.index + 1 < len(self.layers) else None

    def name_of(self, layer: Layer) -> str:
        """The layer's node name: its own, or a fresh ``kind``, ``kind_1``, ..."""
        key = id(layer)
        if key not in self._names:
            if layer.name:
                name = layer.name
            else:
                name = self.builder._fresh(layer.kind)
                k = 1
                while name in self._reserved:
                    name = self.builder._fresh(f"{layer.kind}_{k}")
                    k += 1
            self._names[key] = name
        return self._names[key]

    def record(self, layer: Layer, out: str) -> None:
        self._outputs[self.name_of(layer)] = out

    def outputs_so_far(self) -> set[str]:
        """Ids a layer may refer to: the block input and earlier layers' outputs."""
        return {self.input, *self._outputs.values(), *self._outputs}

    def _next_desc(self, default: TensorDesc) -> TensorDesc:
        return self._extra.pop(0) if self._extra else default

    def add_input(self, tid: str, default: TensorDesc) -> str:
        """Graph input ``tid`` that a layer reads besides the running tensor (an
        encoder's sequence lengths ...), declared once: its descriptor is the call's
        next extra one, else ``default``. Returns its id."""
        b = self.builder
        if tid in b._taken():
            return tid
        return b.add_input(tid, self._next_desc(default))

    def add_kv_slot(self, name: str, past: TensorDesc, *, positions: bool, seq: int) -> KVSlot:
        """Declare the cache inputs/outputs of attention ``name``."""
        b = self.builder
        pk = b.add_input(f"{name}.past_key", self._next_desc(past))
        pv = b.add_input(f"{name}.past_value", self._next_desc(past))
        pos = None
        if positions:
            pos = b.add_input(f"{name}.position_ids",
                              self._next_desc(TensorDesc((seq,), Dtype.INT64)))
        slot = KVSlot(name, pk, pv, f"{name}.present_key", f"{name}.present_value", pos)
        self.kv_slots.append(slot)
        self.extra_outputs += [slot.present_key, slot.present_value]
        return slot

    def add_cache_slot(self, name: str, *, positions: bool) -> CacheSlot:
        """Declare the in-place cache inputs of attention ``name`` (and, for the
        first one, the block's index inputs)."""
        b, c = self.builder, self.cache_desc
        assert c is not None
        kc = b.add_input(f"{name}.key_cache", c)
        vc = b.add_input(f"{name}.value_cache", c)
        ks = vs = None
        if c.dtype == Dtype.INT8:  # an int8 cache: a scale per token and kv head
            from ..ops.paged_int8 import SCALE_DTYPE

            sd = TensorDesc(tuple(c.shape[:3]), SCALE_DTYPE, device=c.device)
            ks = b.add_input(f"{name}.key_scale", sd)
            vs = b.add_input(f"{name}.value_scale", sd)
        tokens = self.builder.desc(self.input).shape[0]
        if not self.cache_slots:
            i32 = Dtype.INT32
            for tid, shape in zip(CACHE_INDEX, ((tokens,), (self.batch, 1), (self.batch,),
                                                    (self.batch,))):
                b.add_input(tid, TensorDesc(shape, i32))
        pos = b.add_input(f"{name}.position_ids", TensorDesc((tokens,), Dtype.INT64)) \
            if positions else None
        slot = CacheSlot(name, kc, vc, pos, ks, vs)
        self.cache_slots.append(slot)
        return slot

    def leftover(self) -> list[TensorDesc]:
        return list(self._extra)


def lower_sequential(layers: Sequence[Layer], input_descs: Sequence[TensorDesc],
                     name: str = "graph_op", *, kv_cache_desc: TensorDesc | None = None,
                     batch: int = 1) -> Graph:
    """The verified graph of ``layers`` applied in order; see the module docstring
    (``kv_cache_desc``/``batch``: the in-place cache form, ``input_descs[0]`` then
    being the ``[T, hidden]`` tokens of ``batch`` rows)."""
    layers = list(layers)
    if not layers:
        raise ParamsError(name, "layers", "a non-empty list of layers", "[]")
    for i, l in enumerate(layers):
        if not isinstance(l, Layer):
            raise ParamsError(name, f"layer {i}", "an atb layer (Linear, LayerNorm, ...)",
                              type(l).__name__)
    descs = [d if isinstance(d, TensorDesc) else TensorDesc.of(d) for d in input_descs]
    if not descs:
        raise InputError(name, "number of inputs", "at least 1 (the block input)", 0)
    b = GraphBuilder(name)
    x = b.add_input(BLOCK_INPUT, descs[0])
    ctx = LoweringContext(b, x, layers, descs[1:], kv_cache_desc, batch)
    cur = x
    for i, layer in enumerate(layers):
        ctx.index = i
        cur = layer.lower(ctx, cur)
        ctx.record(layer, cur)
    extra = ctx.leftover()
    if extra:
        first = len(descs) - len(extra) + 1
        warnings.warn(f"{name}: inputs {first}..{len(descs)} of this sequential block are ignored: "
                      "it reads only its first input (self-attention derives q, k, v from it and "
                      "ResidualAdd adds it back)", UserWarning, stacklevel=2)
        for k, d in enumerate(extra, 1):
            b.add_input(f"unused_{k}", d)
    if cur == x:
        raise GraphError(name, "the layers compute nothing", "at least one layer with a node",
                         [repr(l) for l in layers])
    b.mark_output(cur, *ctx.extra_outputs)
    return b.build()


def kv_cache_slots(graph: Graph) -> list[KVSlot]:
    """The KV-cache slots of a lowered sequential graph, in input order (found by
    the ``<name>.past_key`` naming, so it also works after fusion or loading)."""
    out = []
    for i in graph.inputs:
        if i.endswith(".past_key"):
            layer = i[: -len(".past_key")]
            pos = f"{layer}.position_ids"
            out.append(KVSlot(layer, i, f"{layer}.past_value", f"{layer}.present_key",
                              f"{layer}.present_value", pos if pos in graph.inputs else None))
    return out


def cache_slots(graph: Graph) -> list[CacheSlot]:
    """The attention layers of an in-place cache form graph, in input order."""
    out = []
    for i in graph.inputs:
        if i.endswith(".key_cache"):
            layer = i[: -len(".key_cache")]
            pos, ks = f"{layer}.position_ids", f"{layer}.key_scale"
            scaled = ks in graph.inputs
            out.append(CacheSlot(layer, i, f"{layer}.value_cache",
                                 pos if pos in graph.inputs else None,
                                 ks if scaled else None,
                                 f"{layer}.value_scale" if scaled else None))
    return out
