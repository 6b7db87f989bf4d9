"""The ``rope`` point: a plugin replaces the rotation of q and k itself.

A GraphOp's RoPE node (concatenating and in-place KV-cache forms alike) asks its
own ``rope`` plugins (``op.register_plugin("rope", p)``: an object with
``rope(payload)`` or a callable) and then every global ``atb_rope`` hook, in call
order; the first that returns something other than ``None`` rotates, and its
result replaces the node's outputs. When none answers, the built-in rotation
stands; :func:`builtin_rope` is that same rotation written against the payload,
so a plugin can build on it (rotate scaled positions, rotate part of a head)::

    @hookimpl
    def atb_rope(payload):
        half = replace(payload.rope, rotary_dim=payload.rope.rotary_dim // 2)
        return builtin_rope(replace(payload, rope=half))   # partial rotation

While a rope plugin is present when a GraphOp builds its graph, RoPE is not fused
into the attention (the fused kernel would rotate on its own).
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from ..tensor import describe, framework_of, from_numpy, to_numpy
from .isolation import check_tensors, hook_failure
from .manager import get_plugin_manager
from .payloads import RopePayload

__all__ = ["apply_rope", "builtin_rope", "rope_plugins_present", "rotate_np"]


def rope_plugins_present(local_plugins: Iterable[Any] = ()) -> bool:
    """True when a local ``rope`` plugin or a global ``atb_rope`` hook exists."""
    return bool(list(local_plugins)) or bool(get_plugin_manager().hook.atb_rope.get_hookimpls())


def _call_local(plugin: Any, payload: RopePayload) -> Any:
    method = getattr(plugin, "rope", None)
    if method is None:
        if not callable(plugin):
            raise TypeError(f"{type(plugin).__name__} has no rope method")
        method = plugin
    return method(payload)


def _checked(name: str, where: str, payload: RopePayload, result: Any) -> list:
    before = [payload.q, payload.k]
    if isinstance(result, (list, tuple)) and len(result) == 1 and payload.k is None:
        result = [result[0], None]
    elif payload.k is None and not isinstance(result, (list, tuple)):
        result = [result, None]
    return check_tensors(name, where, before, result)


def apply_rope(payload: RopePayload, local_plugins: Iterable[Any] = (), *,
               node: str = "") -> list | None:
    """``[q_rot, k_rot]`` from the first rope plugin that answers (local ones
    first, then ``atb_rope`` hooks), checked against q and k (count, shape,
    dtype, framework; PluginError naming the plugin); ``None`` when none does."""
    from .points import plugin_name

    where = "rope" + (f" of {node}" if node else "")
    for plugin in local_plugins:
        name = plugin_name(plugin)
        try:
            result = _call_local(plugin, payload)
        except Exception as e:
            raise hook_failure(name, "rope", e) from e
        if result is not None:
            return _checked(name, where, payload, result)
    pm = get_plugin_manager()
    for name, plugin in pm.plugins_in_call_order("atb_rope"):
        for result in pm.call_plugin("atb_rope", plugin, payload=payload):
            return _checked(name, f"atb_rope {where}", payload, result)
    return None


def rotate_np(x: np.ndarray, positions: np.ndarray, base: float, rotary_dim: int,
              rotary_type: str) -> np.ndarray:
    """RoPE of ``x`` ``[B, S, H, D]`` (float64) at ``positions`` ``[B | 1, S]``:
    pair ``i`` of the first ``rotary_dim`` dims turns by ``pos * base**(-2i/rd)``."""
    rd = rotary_dim
    inv = base ** (-np.arange(0, rd, 2, dtype=np.float64) / rd)          # [rd/2]
    ang = np.asarray(positions, dtype=np.float64)[..., None, None] * inv  # [B|1, S, 1, rd/2]
    cos, sin = np.cos(ang), np.sin(ang)
    out = np.array(x, dtype=np.float64, copy=True)
    if rotary_type == "half":
        a, b = x[..., : rd // 2], x[..., rd // 2: rd]
        out[..., : rd // 2] = a * cos - b * sin
        out[..., rd // 2: rd] = b * cos + a * sin
    else:
        a, b = x[..., 0:rd:2], x[..., 1:rd:2]
        out[..., 0:rd:2] = a * cos - b * sin
        out[..., 1:rd:2] = b * cos + a * sin
    return out


def _rotate_torch(x: Any, positions: Any, base: float, rotary_dim: int,
                  rotary_type: str) -> Any:
    # rotate_np in torch, float64 on x's device (CUDA tensors stay there)
    import torch

    rd, xf = rotary_dim, x.to(torch.float64)
    inv = base ** (-torch.arange(0, rd, 2, dtype=torch.float64, device=x.device) / rd)
    ang = positions.to(x.device, torch.float64)[..., None, None] * inv
    cos, sin = ang.cos(), ang.sin()
    out = xf.clone()
    if rotary_type == "half":
        a, b = xf[..., : rd // 2], xf[..., rd // 2: rd]
        out[..., : rd // 2], out[..., rd // 2: rd] = a * cos - b * sin, b * cos + a * sin
    else:
        a, b = xf[..., 0:rd:2], xf[..., 1:rd:2]
        out[..., 0:rd:2], out[..., 1:rd:2] = a * cos - b * sin, b * cos + a * sin
    return out.to(x.dtype)


def builtin_rope(payload: RopePayload) -> list:
    """The built-in rotation of ``payload`` (its ``rope`` parameters at its
    ``positions``), as ``[q_rot, k_rot]`` in the payload's framework and dtypes.
    Computed in float64 (torch on the tensors' device, NumPy for the other
    frameworks): a reference to build plugins on, not a kernel."""
    p = payload.rope
    assert p is not None
    if framework_of(payload.q) == "torch":
        return [None if x is None else _rotate_torch(x, payload.positions, p.base, p.rotary_dim,
                                                     p.rotary_type)
                for x in (payload.q, payload.k)]
    pos = to_numpy(payload.positions)
    out = []
    for x in (payload.q, payload.k):
        if x is None:
            out.append(None)
            continue
        y = rotate_np(np.asarray(to_numpy(x), dtype=np.float64), pos, p.base, p.rotary_dim,
                      p.rotary_type)
        out.append(from_numpy(np.ascontiguousarray(y.astype(describe(x).dtype.numpy)),
                              framework_of(x)))
    return out
