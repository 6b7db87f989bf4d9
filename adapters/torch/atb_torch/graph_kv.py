"""KV-cache plumbing of ``atb_torch.GraphOp`` in torch ops only, so it traces.

A sequential block with ``FlashAttention(kv_cache=True)`` has, per attention layer,
graph inputs ``past_key``/``past_value`` ``[B, P, Hkv*D]`` (and ``position_ids``
``[S]`` with a RoPE layer right before it) after the block input, and outputs
``present_key``/``present_value`` after the block output (see
:mod:`atbcore.graph.sequential`). This module builds those inputs from the
caller's ``kv_cache`` (empty pasts are ``x.new_zeros``, positions ``arange``) and
stores the presents back, with tensor operations and dict/list updates that
``torch.compile`` can follow. Host-side cache objects (``atb.KVCache``) go through
the core GraphOp instead (eager only).

Also :func:`run_guarded`: run an eager core call so that autograd sees its outputs
and refuses to differentiate them with an :class:`AtbError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from atbcore.errors import AtbError, InputError

from .tensors import as_torch

__all__ = ["KVSlotSpec", "is_cache_object", "pasts_of", "full_inputs", "store", "run_guarded"]


@dataclass
class KVSlotSpec:
    """One ``FlashAttention(kv_cache=True)`` layer of a GraphOp."""

    layer: str
    rope: bool
    attention: Any = None      # the atb_torch FlashAttention module (layers form)
    prev: Any = None           # the module before it (packed QKV sizes)
    hidden: int | None = None  # Hkv * D when known up front (graph form)

    @property
    def kv_hidden(self) -> int:
        if self.hidden is not None:
            return self.hidden
        return self.attention.kv_hidden(self.prev)


def is_cache_object(kv: Any) -> bool:
    """An ``atb.KVCache``-like object (host-side lengths, in-place appends)."""
    return hasattr(kv, "seq_lens") and hasattr(kv, "append") and hasattr(kv, "get")


def _bare_pair(kv: Any) -> bool:
    return isinstance(kv, (list, tuple)) and len(kv) == 2 and \
        not isinstance(kv[0], (list, tuple))


def pasts_of(module: Any, kv: Any) -> list[tuple[Tensor, Tensor] | None]:
    """Past ``(key, value)`` per slot of ``module`` from ``kv`` (None = empty)."""
    n = len(module._slots)
    if kv is None:
        return [None] * n
    if isinstance(kv, dict):
        got = kv.get(module._key)
        return [None] * n if got is None else list(got)
    if not isinstance(kv, (list, tuple)):
        raise InputError(module.name, "kv_cache", "None, a dict, (past_key, past_value) pairs "
                         "or an atb.KVCache", type(kv).__name__)
    pairs = [tuple(kv)] if n == 1 and _bare_pair(kv) else [tuple(p) for p in kv]
    if len(pairs) != n or any(len(p) != 2 for p in pairs):
        raise InputError(module.name, "kv_cache pairs", f"{n} (past_key, past_value) pair(s)",
                         f"{len(pairs)} item(s)")
    return [(as_torch(k, module.name), as_torch(v, module.name)) for k, v in pairs]


def full_inputs(xs: Sequence[Tensor], slots: Sequence[KVSlotSpec],
                pasts: Sequence[tuple[Tensor, Tensor] | None]) -> list[Tensor]:
    """Graph inputs in graph order: x, per slot past k, v (positions), extras."""
    x = xs[0]
    if x.dim() != 3:
        raise InputError(slots[0].layer, "block input with a KV cache", "[B, S, hidden]",
                         list(x.shape))
    b, s = x.shape[0], x.shape[1]
    full = [x]
    for slot, past in zip(slots, pasts):
        if past is None:
            empty = x.new_zeros((b, 0, slot.kv_hidden))  # [B, 0, Hkv*D]
            past = (empty, empty)
        full += [past[0], past[1]]
        if slot.rope:
            p = past[0].shape[1]
            full.append(torch.arange(p, p + s, device=x.device, dtype=torch.int64))
    return full + list(xs[1:])


def store(module: Any, kv: Any, presents: list[tuple[Tensor, Tensor]]) -> Any:
    """What the caller gets back as ``kv_cache`` after a call."""
    if kv is None:
        return {module._key: presents}
    if isinstance(kv, dict):
        kv[module._key] = presents
        return kv
    return presents[0] if len(presents) == 1 and _bare_pair(kv) else presents


class _Inference(torch.autograd.Function):
    """Runs ``box["fn"]`` (no autograd inside); backward refuses."""

    @staticmethod
    def forward(ctx: Any, box: dict, *tensors: Tensor) -> tuple[Tensor, ...]:
        res = box["fn"]()
        flat = res if isinstance(res, (list, tuple)) else [res]
        # ``(out, state)`` from a cache call: the state is not a tensor, keep it aside.
        outs = [t for t in _tensors(flat)]
        box["res"] = res
        box["n"] = len(outs)
        ctx.name = box["name"]
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise AtbError(ctx.name, "backward is not implemented (inference-only GraphOp)",
                       "no gradient through atb GraphOps", "a backward call")


def _tensors(items: Sequence[Any]) -> list[Tensor]:
    out = []
    for it in items:
        if isinstance(it, Tensor):
            out.append(it)
        elif isinstance(it, (list, tuple)):
            out += _tensors(it)
    return out


def _replace(items: Any, new: list[Tensor]) -> Any:
    if isinstance(items, Tensor):
        return new.pop(0)
    if isinstance(items, list):
        return [_replace(i, new) for i in items]
    if isinstance(items, tuple):
        return tuple(_replace(i, new) for i in items)
    return items


def run_guarded(name: str, fn: Callable[[], Any], inputs: Sequence[Tensor]) -> Any:
    """``fn()``; when grad is on and an input requires it, the tensor results are
    routed through a Function whose backward raises an AtbError."""
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        return fn()
    box: dict[str, Any] = {"fn": fn, "name": name}
    outs = list(_Inference.apply(box, *[t for t in inputs if t.requires_grad]))
    return _replace(box["res"], outs)
