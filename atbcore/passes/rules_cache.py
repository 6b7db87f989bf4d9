"""KV-cache fusion: ``rope_cache``.

``RoPE(q, k, positions)`` whose rotated k is written (directly or through a
``Reshape`` to heads) by a ``ReshapeAndCache`` and read by nothing else ->
``RopeKVCache(q, k, v, key_cache, value_cache, positions, cos?, sin?, slot_mapping)``:
one kernel rotates q and k and writes k and v into the paged cache rows of
``slot_mapping`` (the rotated k never exists on its own). ``v`` takes k's shape
through a Reshape (a view, with the shape k's own Reshape gave it, so a graph whose
token count varies keeps working) when the cache write read it shaped by heads. This is
the decode step of an in-place cache block (``lower_sequential`` with a
``kv_cache_desc``): RoPE, the key/value reshapes and the cache write become one
launch.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..graph.ir import Node
from .pattern import Alt, Match, Op
from .rewrite import Rewrite, in_consumers_only

__all__ = ["ROPE_CACHE_PATTERN", "rope_cache_rewrite"]

_K_ROT = Op("RoPE", name="rope", output=1, partial=True)
ROPE_CACHE_PATTERN = Op("ReshapeAndCache", (Alt(Op("Reshape", (_K_ROT,), name="kview"), _K_ROT),
                                            "v", "kc", "vc", "slots"), name="cache")


def rope_cache_rewrite(m: Match) -> Rewrite | None:
    """-> ``RopeKVCache(..., slot_mapping)``; see the module docstring."""
    ctx, rope, cache = m.ctx, m["rope"], m["cache"]
    k_rot = rope.outputs[1]
    reader = m["kview"] if "kview" in m else cache
    if not in_consumers_only(ctx, k_rot, {reader.name}):
        return None
    if "kview" in m and not in_consumers_only(ctx, reader.outputs[0], {cache.name}):
        return None
    if len(rope.inputs) < 2 or not rope.inputs[1]:
        return None
    k, v = rope.inputs[1], m["v"]
    dk, dv = ctx.desc(k), ctx.desc(v)
    if dk is None or dv is None or dk.dtype != dv.dtype:
        return None
    add: list[Node] = []
    if tuple(dv.shape) != tuple(dk.shape):
        if int(np.prod(dv.shape)) != int(np.prod(dk.shape)):
            return None
        # k's own reshape keeps its symbolic dims (-1 for the token count); else k's shape
        kp = ctx.producer(k)
        shape = kp.params.shape if kp is not None and kp.op == "Reshape" else tuple(dk.shape)
        name = ctx.fresh(f"{rope.name}.v")
        add.append(Node(name, "Reshape", ctx.params("Reshape", shape=shape), (v,), (name,)))
        v = name
    rest = list(rope.inputs[2:5]) + [""] * (3 - len(rope.inputs[2:5]))   # pos, cos, sin
    values = {f.name: getattr(rope.params, f.name) for f in dataclasses.fields(rope.params)}
    node = Node(rope.name, "RopeKVCache", ctx.params("RopeKVCache", **values),
                (rope.inputs[0], k, v, m["kc"], m["vc"], *rest, m["slots"]),
                (rope.outputs[0], *cache.outputs))
    return Rewrite(add=(*add, node))
