"""Attention-block layers: ``FlashAttention``, ``RoPE``, ``FusedFeedForward``.

``FlashAttention(num_heads=..., num_kv_heads=None, head_dim=None, causal=False,
scale=None, window=None, kv_cache=False, packed=None, qkv_bias=False)``:

* **packed QKV** when a projection precedes it (the previous layer, RoPE layers
  aside, is a ``Linear``; force either way with ``packed=True/False``): the input is ``[B, S, (H + 2*Hkv)*D]``;
* otherwise it is **given hidden states** ``[B, S, hidden]`` and owns its q/k/v
  projections (weights ``q_proj.weight [H*D, hidden]``, ``k_proj.weight``,
  ``v_proj.weight [Hkv*D, hidden]``; ``D = hidden // H`` unless ``head_dim``), lowered
  as three Linears (the ``qkv`` fusion merges them);
* a ``RoPE`` layer right before it rotates its q and k (after the projections);
  ``RoPE(inv_freq=..., attention_factor=..., max_positions=...)`` rotates by a
  cos/sin table of those frequencies (scaled RoPE: llama3, yarn, dynamic NTK ...;
  :mod:`.layers_position`) instead of by ``base``;
* ``qk_norm_eps``: q and k RmsNormed per head before RoPE (weights
  ``q_norm.weight`` / ``k_norm.weight`` ``[D]``, Qwen3);
* ``kv_cache=True``: the graph gets inputs ``<name>.past_key`` / ``<name>.past_value``
  ``[B, P, Hkv*D]`` (P = 0 on the first call) and outputs ``<name>.present_key`` /
  ``<name>.present_value`` = past concatenated with the new keys/values along the
  sequence (a contiguous cache; ``Concat`` in the IR); causal masks are bottom-right
  aligned, so new queries see the whole past. With a RoPE layer, the graph also
  takes ``<name>.position_ids`` (int64 ``[S]``: P + arange(S)). See
  :func:`atbcore.graph.sequential.kv_cache_slots`. In the in-place cache form
  (:func:`~atbcore.graph.sequential.lower_sequential` with ``kv_cache_desc``) the
  new keys/values go into the cache layer with ``ReshapeAndCache`` and the attention
  is a ``PagedAttention`` over it (token-major tensors; no concatenation).

The output ``[B, S, H*D]`` has no output projection (a following ``Linear`` is).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..errors import ParamsError, ShapeError
from ..tensor import TensorDesc
from .layers import Layer, Linear, _positive, uniform

if TYPE_CHECKING:
    from .sequential import LoweringContext

__all__ = ["FlashAttention", "RoPE", "FusedFeedForward"]


class RoPE(Layer):
    """Rotary embedding. Right before a ``FlashAttention`` it rotates that
    attention's q and k; elsewhere it rotates its input ``[B, S, H*D]`` as q."""

    kind = "rope"

    def __init__(self, name: str | None = None, *, num_heads: int | None = None,
                 head_dim: int | None = None, rotary_dim: int | None = None,
                 base: float = 10000.0, rotary_type: str = "half",
                 inv_freq: Sequence[float] | None = None, attention_factor: float = 1.0,
                 max_positions: int | None = None) -> None:
        """``inv_freq`` (``[rotary_dim // 2]``, e.g. a scaled RoPE's) and
        ``attention_factor`` replace ``base``: the rotation reads a cos/sin table made
        from them (:func:`~.layers_position.rope_table_inputs`), at most
        ``max_positions`` rows (positions past it are refused)."""
        super().__init__(name)
        self.params = {"num_heads": num_heads, "head_dim": head_dim, "rotary_dim": rotary_dim,
                       "base": base, "rotary_type": rotary_type}
        from ..ops.registry import get_op

        p = get_op("RoPE").make_params({k: v for k, v in self.params.items() if v is not None})
        self.inv_freq = None if inv_freq is None else tuple(float(f) for f in inv_freq)
        self.attention_factor = float(attention_factor)
        self.max_positions = None if max_positions is None else int(max_positions)
        if self.inv_freq is not None and rotary_dim is not None \
                and 2 * len(self.inv_freq) != p.rotary_dim:
            raise ParamsError("RoPE", "inv_freq length (rotary_dim / 2)", p.rotary_dim // 2,
                              len(self.inv_freq))
        if self.max_positions is not None and self.max_positions < 1:
            raise ParamsError("RoPE", "max_positions", "an int >= 1 or None", max_positions)

    def rope_params(self, **geometry: Any) -> dict[str, Any]:
        """The RoPE op's params (``geometry``: the attention's heads and head_dim)."""
        p = {k: v for k, v in self.params.items() if v is not None}
        if self.inv_freq is not None:
            p["rotary_dim"] = 2 * len(self.inv_freq)
        return {**p, **geometry}

    def lower(self, ctx: "LoweringContext", x: str) -> str:
        if isinstance(ctx.next_layer, FlashAttention):
            ctx.pending_rope = self
            return x
        if self.inv_freq is not None:
            raise ParamsError(ctx.name_of(self), "placement of a RoPE with inv_freq",
                              "right before a FlashAttention", "elsewhere")
        p = {k: v for k, v in self.params.items() if v is not None}
        return ctx.builder.add_node("RoPE", [x], p, name=ctx.name_of(self))[0]


class FlashAttention(Layer):
    """Self-attention over packed QKV or hidden states; see the module docstring."""

    kind = "attention"

    def __init__(self, name: str | None = None, *, num_heads: int, num_kv_heads: int | None = None,
                 head_dim: int | None = None, causal: bool = False, scale: float | None = None,
                 window: int | None = None, kv_cache: bool = False, packed: bool | None = None,
                 qkv_bias: bool = False, qk_norm_eps: float | None = None,
                 seed: int | None = None) -> None:
        super().__init__(name, seed=seed)
        _positive("FlashAttention", "num_heads", num_heads)
        _positive("FlashAttention", "num_kv_heads", num_kv_heads, optional=True)
        _positive("FlashAttention", "head_dim", head_dim, optional=True)
        if num_kv_heads is not None and num_heads % num_kv_heads:
            raise ParamsError("FlashAttention", "num_kv_heads must divide num_heads",
                              f"a divisor of {num_heads}", num_kv_heads)
        self.num_heads, self.num_kv_heads = int(num_heads), int(num_kv_heads or num_heads)
        self.head_dim, self.causal, self.scale, self.window = head_dim, bool(causal), scale, window
        self.kv_cache, self.packed, self.qkv_bias = bool(kv_cache), packed, bool(qkv_bias)
        if qk_norm_eps is not None and not float(qk_norm_eps) > 0:
            raise ParamsError("FlashAttention", "qk_norm_eps", "> 0 or None", repr(qk_norm_eps))
        self.qk_norm_eps = None if qk_norm_eps is None else float(qk_norm_eps)

    def _weight_names(self) -> set[str]:
        names = {f"{p}_proj.weight" for p in "qkv"}
        if self.qk_norm_eps is not None:  # per-head RmsNorm of q and k (Qwen3)
            names |= {"q_norm.weight", "k_norm.weight"}
        return names | ({f"{p}_proj.bias" for p in "qkv"} if self.qkv_bias else set())

    def _qk_norm(self, ctx: "LoweringContext", name: str, q: str, k: str, hd: int
                 ) -> tuple[str, str]:
        if self.qk_norm_eps is None:
            return q, k
        from .layers_position import head_norm

        if not {"q_norm.weight", "k_norm.weight"} <= set(self._weights):
            self._ensure(name, {"q_norm.weight": (hd,), "k_norm.weight": (hd,)},
                         {"q_norm.weight": lambda r, s: np.ones(s),
                          "k_norm.weight": lambda r, s: np.ones(s)})
        return (head_norm(ctx, self, name, "q", q, hd, self.qk_norm_eps),
                head_norm(ctx, self, name, "k", k, hd, self.qk_norm_eps))

    def _params(self) -> dict[str, Any]:
        p = {"num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads, "causal": self.causal}
        if self.scale is not None:
            p["scale"] = self.scale
        if self.window is not None:
            p["window"] = self.window
        return p

    def _split_packed(self, ctx: "LoweringContext", name: str, x: str, split: bool
                      ) -> tuple[str, str, str, int]:
        d = ctx.builder.desc(x)
        h, hkv = self.num_heads, self.num_kv_heads
        if d.rank != (2 if ctx.cache_desc is not None else 3) or d.shape[-1] % (h + 2 * hkv):
            raise ShapeError(name, "packed QKV input [B, S, (num_heads + 2*num_kv_heads) * head_dim] "
                             "([T, ...] with an atb.KVCache)",
                             f"a last dim divisible by {h + 2 * hkv}", f"shape {list(d.shape)}")
        hd = d.shape[-1] // (h + 2 * hkv)
        if self.head_dim is not None and hd != self.head_dim:
            raise ShapeError(name, "packed QKV head_dim", self.head_dim, hd)
        if not split:  # the attention reads the packed tensor itself
            return x, "", "", hd
        q, k, v = ctx.builder.add_node("Split", [x], {"dim": -1, "sizes": (h * hd, hkv * hd, hkv * hd)},
                                       name=f"{name}.split")
        return q, k, v, hd

    def _project(self, ctx: "LoweringContext", name: str, x: str, split: bool = True
                 ) -> tuple[str, str, str, int]:
        d = ctx.builder.desc(x)
        hidden = d.shape[-1]
        if self.head_dim is None and hidden % self.num_heads:
            raise ShapeError(name, "hidden size divisible by num_heads", f"a multiple of "
                             f"{self.num_heads}", f"shape {list(d.shape)}")
        hd = self.head_dim or hidden // self.num_heads
        outs = {"q": self.num_heads * hd, "k": self.num_kv_heads * hd, "v": self.num_kv_heads * hd}
        shapes = {f"{p}_proj.weight": (o, hidden) for p, o in outs.items()}
        if self.qkv_bias:
            shapes.update({f"{p}_proj.bias": (o,) for p, o in outs.items()})
        bound = 1.0 / np.sqrt(hidden)
        self._ensure(name, shapes, {k: uniform(bound) for k in shapes})
        res = []
        for p in "qkv":
            ins = [x, self._add_weight(ctx, name, f"{p}_proj.weight", d)]
            if self.qkv_bias:
                ins.append(self._add_weight(ctx, name, f"{p}_proj.bias", d))
            res.append(ctx.builder.add_node("Linear", ins, name=f"{name}.{p}_proj")[0])
        return res[0], res[1], res[2], hd

    def lower(self, ctx: "LoweringContext", x: str) -> str:
        name = ctx.name_of(self)
        rope, ctx.pending_rope = ctx.pending_rope, None
        before = ctx.layers[:ctx.index]
        while before and isinstance(before[-1], RoPE):  # a RoPE sits between projection and us
            before = before[:-1]
        packed = self.packed if self.packed is not None else bool(before) and isinstance(
            before[-1], Linear)
        split = rope is not None or self.kv_cache or self.qk_norm_eps is not None
        q, k, v, hd = (self._split_packed if packed else self._project)(ctx, name, x, split)
        if not k:  # packed QKV straight into the attention
            return ctx.builder.add_node("FlashAttention", [q], self._params(), name=name)[0]
        q, k = self._qk_norm(ctx, name, q, k, hd)
        if ctx.cache_desc is not None:
            return self._lower_in_place(ctx, name, q, k, v, hd, rope)
        dq = ctx.builder.desc(q)
        pos = None
        if self.kv_cache:
            past = TensorDesc((dq.shape[0], 0, self.num_kv_heads * hd), dq.dtype)
            slot = ctx.add_kv_slot(name, past, positions=rope is not None, seq=dq.shape[1])
            pos = slot.position_ids
        if rope is not None:
            from .layers_position import rope_table_inputs

            p = rope.rope_params(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                 head_dim=hd)
            tables = rope_table_inputs(ctx, rope)
            if tables and not pos:  # no past: positions 0 .. S-1, the tables' first rows
                tables = [ctx.builder.add_node("Slice", [t], {"offsets": (0, 0),
                                                              "sizes": (dq.shape[1], -1)},
                                               name=f"{t}.rows")[0] for t in tables]
            q, k = ctx.builder.add_node("RoPE", [q, k] + ([pos] if pos else []) + tables, p,
                                        name=ctx.name_of(rope))
        if self.kv_cache:
            k, = ctx.builder.add_node("Concat", [slot.past_key, k], {"dim": 1},
                                      name=slot.present_key)
            v, = ctx.builder.add_node("Concat", [slot.past_value, v], {"dim": 1},
                                      name=slot.present_value)
        return ctx.builder.add_node("FlashAttention", [q, k, v], self._params(), name=name)[0]


    def _lower_in_place(self, ctx: "LoweringContext", name: str, q: str, k: str, v: str,
                        hd: int, rope: Any) -> str:
        """Token-major q/k/v ``[T, *]``: RoPE (as ``[1, T, *]``), the cache write
        and ``PagedAttention`` over the cache layer; returns ``[T, H*D]``."""
        from .sequential import CACHE_INDEX

        if not self.kv_cache:
            raise ShapeError(name, "attention in a block run with an atb.KVCache",
                             "FlashAttention(kv_cache=True)", "kv_cache=False")
        b, h, hkv = ctx.builder, self.num_heads, self.num_kv_heads
        slot = ctx.add_cache_slot(name, positions=rope is not None)
        if rope is not None:
            from .layers_position import rope_table_inputs

            p = rope.rope_params(num_heads=h, num_kv_heads=hkv, head_dim=hd)
            q3, = b.add_node("Reshape", [q], {"shape": (1, -1, h * hd)}, name=f"{name}.q_bsh")
            k3, = b.add_node("Reshape", [k], {"shape": (1, -1, hkv * hd)}, name=f"{name}.k_bsh")
            q, k = b.add_node("RoPE", [q3, k3, slot.position_ids] + rope_table_inputs(ctx, rope),
                              p, name=ctx.name_of(rope))
        qh, = b.add_node("Reshape", [q], {"shape": (-1, h, hd)}, name=f"{name}.q_heads")
        kh, = b.add_node("Reshape", [k], {"shape": (-1, hkv, hd)}, name=f"{name}.k_heads")
        vh, = b.add_node("Reshape", [v], {"shape": (-1, hkv, hd)}, name=f"{name}.v_heads")
        slots, tables, lens, qlens = CACHE_INDEX
        p = {"num_heads": h, "num_kv_heads": hkv, "head_dim": hd, "causal": self.causal}
        if self.scale is not None:
            p["scale"] = self.scale
        if self.window is not None:
            p["window"] = self.window
        if slot.key_scale:  # an int8 cache: quantized write, dequantizing read
            kc, vc, ks, vs = b.add_node("ReshapeAndCacheInt8", [kh, vh, slot.key_cache,
                                        slot.value_cache, slot.key_scale, slot.value_scale,
                                        slots], name=f"{name}.cache_write")
            o, = b.add_node("PagedAttentionInt8", [qh, kc, vc, ks, vs, tables, lens, qlens], p,
                            name=name)
        else:
            kc, vc = b.add_node("ReshapeAndCache", [kh, vh, slot.key_cache, slot.value_cache,
                                                    slots], name=f"{name}.cache_write")
            o, = b.add_node("PagedAttention", [qh, kc, vc, tables, lens, qlens], p, name=name)
        return b.add_node("Reshape", [o], {"shape": (-1, h * hd)}, name=f"{name}.merge")[0]


class FusedFeedForward(Layer):
    """``down(act(gate(x)) * up(x))`` (gated activations) or ``down(act(up(x)))``,
    with its own weights ``gate_proj.weight [I, H]``, ``up_proj.weight [I, H]``,
    ``down_proj.weight [H, I]`` (+ ``.bias`` with ``bias=True``)."""

    kind = "ffn"

    def __init__(self, name: str | None = None, *, intermediate_size: int,
                 activation_type: str = "swiglu", bias: bool = False, seed: int | None = None) -> None:
        super().__init__(name, seed=seed)
        _positive("FusedFeedForward", "intermediate_size", intermediate_size)
        from ..ops.activation import get_activation

        act = get_activation(activation_type, "FusedFeedForward")
        self.intermediate_size, self.activation_type = int(intermediate_size), act.name
        self.gated, self.bias = act.gated, bool(bias)

    def _projs(self) -> tuple[str, ...]:
        return ("gate_proj", "up_proj", "down_proj") if self.gated else ("up_proj", "down_proj")

    def _weight_names(self) -> set[str]:
        names = {f"{p}.weight" for p in self._projs()}
        return names | ({f"{p}.bias" for p in self._projs()} if self.bias else set())

    def lower(self, ctx: "LoweringContext", x: str) -> str:
        name = ctx.name_of(self)
        d = ctx.builder.desc(x)
        hid, inter = d.shape[-1], self.intermediate_size
        shapes = {f"{p}.weight": ((hid, inter) if p == "down_proj" else (inter, hid))
                  for p in self._projs()}
        if self.bias:
            shapes.update({f"{p}.bias": ((hid,) if p == "down_proj" else (inter,))
                           for p in self._projs()})
        init = {k: uniform(1.0 / np.sqrt(inter if k.startswith("down") else hid)) for k in shapes}
        self._ensure(name, shapes, init)
        ins = [x] + [self._add_weight(ctx, name, f"{p}.weight", d) for p in self._projs()]
        if self.bias:
            ins += [self._add_weight(ctx, name, f"{p}.bias", d) for p in self._projs()]
        params = {"hidden_size": hid, "intermediate_size": inter,
                  "activation_type": self.activation_type, "bias": self.bias}
        return ctx.builder.add_node("FusedFeedForward", ins, params, name=name)[0]

