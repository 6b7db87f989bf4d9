"""``torch.compile(model, backend="atb")``: atb's fused ops over the FX graph.

Dynamo hands the backend a torch-level FX graph; :data:`RULES` rewrite what atb has a
fused kernel for into its ``torch.ops.atb.*`` custom ops, and the rest runs as
traced (eager) or through inductor:

* RMSNorm written out (``x.to(f32)``, ``pow(2).mean(-1, keepdim=True)``, ``+ eps``,
  ``rsqrt``, ``* ``, ``.to(dtype)``, ``weight *``) -> ``atb.rms_norm``;
* ``silu(a) * b`` -> ``atb.swiglu(a, b)``;
* ``scaled_dot_product_attention`` (no dropout) -> ``atb.flash_attention`` (GQA
  without repeating K/V, causal when the query and key lengths are the same).

Run as traced (the default), :func:`to_eager` then points the rewritten nodes at
their eager forms (``eager_rms_norm``, ``eager_swiglu``, ``eager_flash_attention``:
the same kernels without the custom-op dispatch, a decode step's attention on the C
decode attention) and ``F.linear`` of at most :data:`LINEAR_MAX_ROWS` rows at the C
matmul over panel-packed weights (``eager_linear``); with ``dynamic=True`` module
floats (``eps``, ``scaling``) arrive at run time, which these forms take. Where
autograd records, the custom ops run (their backward refuses).

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

__all__ = ["atb_backend", "rewrite", "to_eager", "RULES", "eager_linear", "eager_rms_norm",
           "eager_swiglu", "eager_flash_attention", "LINEAR_MAX_ROWS"]


def _value(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def _is_method(node: Any, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target == name


def _is_fn(node: Any, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _strip_to(node: Any) -> Any:
    """``x`` of ``x.to(...)`` (a dtype cast HF writes around its norms), else ``node``."""
    return node.args[0] if _is_method(node, "to") else node


def _is_float(x: Any, runtime: bool) -> bool:
    """A float argument: a constant, or (``runtime``) a run-time float of the graph
    (``torch.compile(dynamic=True)`` passes module floats such as ``eps`` and
    ``scaling`` in as 0-d tensors read with ``.item()``)."""
    return isinstance(x, float) or (runtime and _is_method(x, "item"))


def _rms_norm(node: fx.Node, runtime_floats: bool = False) -> Any:
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
        if not (_is_method(mean, "mean") and _is_float(eps, runtime_floats)
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


def _swiglu(node: fx.Node, runtime_floats: bool = False) -> Any:
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


def _sdpa(node: fx.Node, runtime_floats: bool = False) -> Any:
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
    if isinstance(scale, (float, int)):
        scale = float(scale)
    elif scale is None:
        scale = 0.0
    elif not _is_float(scale, runtime_floats):
        return None
    # head counts: 0 (inferred from the BNSD shapes) where they are symbolic
    heads = q.shape[1] if isinstance(q.shape[1], int) else 0
    kv_heads = k.shape[1] if isinstance(k.shape[1], int) else 0
    return torch.ops.atb.flash_attention.default, (
        kw["query"], kw["key"], kw["value"], mask, None, heads, kv_heads, scale, causal, 0,
        "BNSD")


# (name, rule): a rule returns (target, args) for the node a pattern ends at, or None;
# ``runtime_floats`` lets it take run-time floats (the eager graph's calls read them)
RULES: list[tuple[str, Callable[[fx.Node], Any]]] = [
    ("rms_norm", _rms_norm), ("swiglu", _swiglu), ("flash_attention", _sdpa)]


def rewrite(gm: fx.GraphModule, runtime_floats: bool = False) -> dict[str, int]:
    """Rewrite ``gm`` in place with :data:`RULES`; returns the rewrites per rule.
    ``runtime_floats``: also where ``eps``/``scale`` are run-time floats (a graph
    that then runs as traced, through :func:`to_eager`)."""
    from . import library  # noqa: F401  (registers torch.ops.atb.*)

    counts = {name: 0 for name, _ in RULES}
    for node in list(gm.graph.nodes):
        for name, rule in RULES:
            hit = rule(node, runtime_floats) if node.op == "call_function" else None
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


# -------------------------------------------------------------- the eager graph's calls
# The graph run as traced (eager) calls these instead of the custom ops: the same
# kernels without torch.library's dispatch and the op's re-validation, which cost
# more than a decode step's norm or attention itself. Where autograd records, or a
# call is not one the C kernel takes as is, the custom op runs (with its checks).


def _recording(*xs: Any) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in xs)


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``torch.ops.atb.rms_norm`` as the eager graph calls it."""
    from atbcore.backends.cpu_kernels import torch_ops as ck

    if (not _recording(x, weight) and weight.dim() == 1 and x.dim() >= 1
            and x.shape[-1] == weight.shape[0] and ck.why_not(x, weight) is None):
        return ck.rms_norm(x, weight, x.shape[-1], eps)[0]
    return torch.ops.atb.rms_norm.default(x, weight, eps)


def eager_swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.ops.atb.swiglu`` (``silu(a) * b``) as the eager graph calls it."""
    from atbcore.backends.cpu_kernels import torch_ops as ck
    from atbcore.backends.cpu_kernels.torch_act import activation

    if (not _recording(a, b) and a.dim() >= 1 and a.shape == b.shape and a.dtype == b.dtype
            and ck.why_not(a, b) is None):
        return activation(a, "silu", up=b)
    return torch.ops.atb.swiglu.default(a, b)


def eager_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: torch.Tensor | None, seq_lens: torch.Tensor | None,
                          num_heads: int, num_kv_heads: int, scale: float, causal: bool,
                          window: int, layout: str) -> torch.Tensor:
    """``torch.ops.atb.flash_attention`` as the eager graph calls it: a decode step
    (one query row, BNSD, as SDPA's operands are) goes straight to the C decode
    attention."""
    if (layout == "BNSD" and seq_lens is None and not window and q.dim() == 4
            and q.shape[2] == 1 and not _recording(q, k, v)):
        from atbcore.backends.torch.attention import decode_bnsd

        out = decode_bnsd(q, k, v, scale=scale or q.shape[-1] ** -0.5, mask=mask)
        if out is not None:
            return out
    return torch.ops.atb.flash_attention.default(q, k, v, mask, seq_lens, num_heads,
                                                 num_kv_heads, scale, causal, window, layout)


# the C matmul serves a linear of at most this many rows (a decode step's); more rows
# run torch's GEMM
LINEAR_MAX_ROWS = 64


def eager_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` as the eager graph calls it: few rows on the CPU run the C matmul
    over the weight's panels (packed once per weight and version, as atb's Linear
    reads them); everything else is ``F.linear``."""
    if (x.dim() >= 1 and weight.dim() == 2 and x.shape[-1] == weight.shape[1]
            and 0 < x.numel() <= LINEAR_MAX_ROWS * x.shape[-1]
            and not _recording(x, weight, bias) and _c_linear_takes(x, weight, bias)):
        from atbcore.backends.cpu_kernels.torch_linear import linear_rows
        from atbcore.backends.torch.weight_layout import panels

        packed, meta = panels(weight)
        return linear_rows(x, meta, bias=bias, panels=packed)
    return torch.nn.functional.linear(x, weight, bias)


def _c_linear_takes(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    from atbcore.backends.cpu_kernels import torch_ops as ck
    from atbcore.backends.torch.weight_layout import panels_enabled

    return (x.dtype == w.dtype and (b is None or (b.dtype == w.dtype and b.dim() == 1))
            and not w.is_inference() and panels_enabled() and ck.why_not(x, w, b) is None)


def _linear(node: fx.Node) -> Any:
    """``F.linear(x, weight[, bias])`` of a 2-D float weight (eager graphs only)."""
    if not _is_fn(node, torch.nn.functional.linear, torch._C._nn.linear):
        return None
    w = _value(node.kwargs.get("weight", node.args[1] if len(node.args) > 1 else None))
    if w is None or w.dim() != 2 or not w.dtype.is_floating_point:
        return None
    names = ("input", "weight", "bias")
    kw = dict(zip(names, node.args)) | dict(node.kwargs)
    return eager_linear, (kw["input"], kw["weight"], kw.get("bias"))


# the custom op each rule ends in -> what the eager graph calls
EAGER_CALLS: dict[Any, Callable[..., Any]] = {}


def to_eager(gm: fx.GraphModule) -> dict[str, int]:
    """Point ``gm``'s atb custom-op calls at their eager forms and its few-row
    ``F.linear`` calls at :func:`eager_linear` (for a graph run as traced, not one
    handed to inductor); returns the linears rewritten."""
    if not EAGER_CALLS:
        EAGER_CALLS.update({torch.ops.atb.rms_norm.default: eager_rms_norm,
                            torch.ops.atb.swiglu.default: eager_swiglu,
                            torch.ops.atb.flash_attention.default: eager_flash_attention})
    linears = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in EAGER_CALLS:
            node.target = EAGER_CALLS[node.target]
            continue
        hit = _linear(node)
        if hit is not None:
            node.target, node.args = hit
            node.kwargs = {}
            linears += 1
    gm.recompile()
    return {"linear": linears}


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
    counts = rewrite(gm, runtime_floats=inner == "eager")
    if inner == "eager":
        counts |= to_eager(gm)
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
