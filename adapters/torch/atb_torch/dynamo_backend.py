"""``torch.compile(model, backend="atb")``: atb's fused ops over the FX graph.

Dynamo hands the backend a torch-level FX graph; :data:`RULES` rewrite what atb has a
fused kernel for into its ``torch.ops.atb.*`` custom ops, and the rest runs as
traced (eager) or through inductor:

* RMSNorm written out (``x.to(f32)``, ``pow(2).mean(-1, keepdim=True)``, ``+ eps``,
  ``rsqrt``, ``* ``, ``.to(dtype)``, ``weight *``) -> ``atb.rms_norm``;
* ``silu(a) * b`` -> ``atb.swiglu(a, b)``;
* ``scaled_dot_product_attention`` (no dropout) -> ``atb.flash_attention`` (GQA
  without repeating K/V, causal when the query and key lengths are the same).

``options={"inner": "inductor"}`` hands the rewritten graph to inductor instead.

The backend is registered with Dynamo when this module is imported and, for an
installed atb, through the ``torch_dynamo_backends`` entry point, so
``torch.compile(m, backend="atb")`` works without importing anything first.
``rewrite(gm)`` alone returns the number of rewrites per rule (tests, diagnostics).
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from atbcore.log import logger

__all__ = ["atb_backend", "rewrite", "RULES"]


def _value(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _is_method(node: Any, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target == name


def _is_fn(node: Any, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _strip_to(node: Any) -> Any:
    """``x`` of ``x.to(...)`` (a dtype cast HF writes around its norms), else ``node``."""
    return node.args[0] if _is_method(node, "to") else node


def _rms_norm(node: fx.Node) -> Any:
    """``weight * (h * rsqrt(mean(h ** 2, -1, keepdim) + eps)).to(dtype)``, h = x.to(f32)."""
    if not _is_fn(node, operator.mul, torch.mul):
        return None
    for weight, normed in (node.args, node.args[::-1]):
        scaled = _strip_to(normed)
        if not _is_fn(scaled, operator.mul, torch.mul):
            continue
        h, rs = scaled.args
        if not _is_fn(rs, torch.rsqrt):
            h, rs = rs, h
        if not _is_fn(rs, torch.rsqrt) or not _is_fn(rs.args[0], operator.add):
            continue
        mean, eps = rs.args[0].args
        if not (_is_method(mean, "mean") and isinstance(eps, float)
                and tuple(mean.args[1:]) in ((-1,), ([-1],)) and mean.kwargs.get("keepdim")
                and _is_method(mean.args[0], "pow") and mean.args[0].args[1] == 2
                and mean.args[0].args[0] is h):
            continue
        x, w = _strip_to(h), _value(weight)
        xv = _value(x)
        if w is None or xv is None or w.dim() != 1 or xv.dtype != w.dtype:
            continue
        return torch.ops.atb.rms_norm.default, (x, weight, eps)
    return None


def _swiglu(node: fx.Node) -> Any:
    """``silu(a) * b`` of same-shape tensors."""
    if not _is_fn(node, operator.mul, torch.mul):
        return None
    for act, up in (node.args, node.args[::-1]):
        if _is_fn(act, torch.nn.functional.silu) and not act.kwargs.get("inplace") \
                and len(act.args) == 1:
            a, b = _value(act.args[0]), _value(up)
            if a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype:
                return torch.ops.atb.swiglu.default, (act.args[0], up)
    return None


def _sdpa(node: fx.Node) -> Any:
    """``scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal, scale, gqa)``."""
    if not _is_fn(node, torch.nn.functional.scaled_dot_product_attention,
                  torch._C._nn.scaled_dot_product_attention):
        return None
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    kw = dict(zip(names, node.args)) | dict(node.kwargs)
    q, k = _value(kw["query"]), _value(kw["key"])
    if q is None or k is None or q.dim() != 4 or k.dim() != 4 or kw.get("dropout_p", 0.0):
        return None
    causal = bool(kw.get("is_causal", False))
    # SDPA's causal mask is top-left aligned, atb's bottom-right: the same only when
    # the query and key lengths are
    if causal and str(q.shape[2]) != str(k.shape[2]):
        return None
    mask = kw.get("attn_mask")
    if isinstance(mask, fx.Node) and _value(mask) is not None and _value(mask).dim() > 4:
        return None
    scale = kw.get("scale")
    if not isinstance(scale, (float, int, type(None))):
        return None
    return torch.ops.atb.flash_attention.default, (
        kw["query"], kw["key"], kw["value"], mask, None, int(q.shape[1]), int(k.shape[1]),
        float(scale) if scale is not None else 0.0, causal, 0, "BNSD")


# (name, rule): a rule returns (target, args) for the node a pattern ends at, or None
RULES: list[tuple[str, Callable[[fx.Node], Any]]] = [
    ("rms_norm", _rms_norm), ("swiglu", _swiglu), ("flash_attention", _sdpa)]


def rewrite(gm: fx.GraphModule) -> dict[str, int]:
    """Rewrite ``gm`` in place with :data:`RULES`; returns the rewrites per rule."""
    from . import library  # noqa: F401  (registers torch.ops.atb.*)

    counts = {name: 0 for name, _ in RULES}
    for node in list(gm.graph.nodes):
        for name, rule in RULES:
            hit = rule(node) if node.op == "call_function" else None
            if hit is None:
                continue
            target, args = hit
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(target, args)
            # not the pattern end's example value: the new op's strides may differ
            # (inductor would hold the kernel to them); later passes trace afresh
            new.meta = {k: v for k, v in node.meta.items() if k not in ("example_value", "val")}
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            counts[name] += 1
            break
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return counts


def atb_backend(gm: fx.GraphModule, example_inputs: list[Any], mode: Any = None,
                options: dict | None = None) -> Callable[..., Any]:
    """The Dynamo backend: :func:`rewrite`, then the graph runs as traced (eager), or
    through inductor with ``torch.compile(m, backend="atb", options={"inner": "inductor"})``
    (atb's ops stay calls into atb; inductor generates code for the rest)."""
    from atbcore.errors import ParamsError

    options = dict(options or {})
    inner = options.pop("inner", "eager")
    if inner not in ("eager", "inductor") or options:
        raise ParamsError("torch.compile(backend='atb')", "options",
                          "{'inner': 'eager' | 'inductor'}", repr({"inner": inner, **options}))
    counts = rewrite(gm)
    logger.info("torch.compile(backend='atb'): %s; the rest runs %s",
                ", ".join(f"{n} x{c}" for n, c in counts.items()), inner)
    if inner == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)
    return gm.forward


def _register() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "atb" not in _BACKENDS:
        register_backend(atb_backend, name="atb")


_register()
