"""LinearActivation on the CPU as one oneDNN GEMM (``torch.ops.mkldnn._linear_pointwise``).

* LinearActivation: ``act(x @ W.T + b)`` with fp32 sums and the activation applied
  before the one rounding -- the op's definition. An encoder's FFN up projection is
  this call: the oneDNN GEMM with its bias, then atb's C activation in place over the
  fp32 result (the formula's values, +-inf included, as the composite's). Not
  oneDNN's own GELU post-op: its erf GELU on AVX2 cost several times the C
  kernel's pass over the result, and it turns +-inf into NaN, which took a second
  pass over the result to catch. Taken for fp32/bf16 activations with weights (and bias) of x's
  dtype, GELU (exact or tanh) and ReLU, on a torch built with oneDNN; other calls keep
  the composite. Where oneDNN has no bf16 inner product (CPUs without
  AVX512-BF16/AMX) a bf16 call of more than :data:`DNNL_MIN_ROWS` rows runs the fp32
  GEMM on widened operands (the same fp32 sums the composite takes).

Plain Linears run on the C matmul at every row count (:mod:`.linear`):
``benchmarks/dense_linear_route.py`` measures the two GEMMs at encoder and prefill
shapes."""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

from ...runtime.binding import POOL_ROWS_MAX, Slot, getter

__all__ = ["why_not_dnnl", "dnnl_linear_activation",
           "bind_dnnl_linear_activation", "dnnl_available", "DNNL_MIN_ROWS"]

# Above this many rows a bf16 LinearActivation on a CPU without a oneDNN bf16 inner
# product runs the fp32 GEMM on widened operands; up to it, the composite (few-row
# calls: widening the weight per call would cost more than the GEMM).
DNNL_MIN_ROWS = POOL_ROWS_MAX

# atb activation -> (oneDNN post-op, algorithm)
POST_OPS = {"gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", "")}
_DTYPES = (torch.float32, torch.bfloat16)


def dnnl_available() -> bool:
    """Whether torch has oneDNN's linear with post-ops."""
    try:
        return bool(torch.backends.mkldnn.is_available()) and \
            hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):  # pragma: no cover - torch without oneDNN
        return False


def why_not_dnnl(p: Any, x: Any, w: Any, b: Any) -> str | None:
    """Why the oneDNN GEMM does not take this LinearActivation (None = it does)."""
    def desc(t: Any) -> tuple[Any, str, tuple[int, ...]]:
        if type(t) is Slot:
            return t.desc.dtype.torch, str(t.desc.device), tuple(t.desc.shape)
        return t.dtype, str(t.device), tuple(t.shape)
    if p.quant is not None:
        return f"quant {p.quant}"
    if p.activation_type not in POST_OPS:
        return f"activation {p.activation_type} is no oneDNN post-op here"
    xd, dev, xs = desc(x)
    if not dev.startswith("cpu"):
        return f"oneDNN runs on the CPU, not {dev}"
    if xd not in _DTYPES or desc(w)[0] != xd or (b is not None and desc(b)[0] != xd):
        return "x, weight and bias not all fp32 or all bf16"
    if type(w) is Slot or type(b) is Slot:
        return "the weight or bias changes per run"
    if not dnnl_available():
        return "torch built without oneDNN (mkldnn)"
    if xd == torch.bfloat16 and not _bf16_inner_product() and \
            math.prod(xs[:-1]) <= DNNL_MIN_ROWS:
        return (f"bf16 without a oneDNN bf16 inner product on this CPU: widened to fp32 "
                f"only above {DNNL_MIN_ROWS} rows")
    return None


@functools.lru_cache(maxsize=None)
def _bf16_inner_product() -> bool:
    """Whether oneDNN runs a bf16 inner product here (it refuses one on CPUs without
    bf16 instructions: "could not create a primitive descriptor")."""
    x = torch.zeros(2, 16, dtype=torch.bfloat16)
    try:
        torch.ops.mkldnn._linear_pointwise(x, torch.zeros(16, 16, dtype=torch.bfloat16), None,
                                           "none", [], "")
    except RuntimeError:
        return False
    return True


def dnnl_linear_activation(p: Any, x: torch.Tensor, w: torch.Tensor, b: Any) -> torch.Tensor:
    """The call itself (``why_not_dnnl`` checked): ``[..., K] -> [..., N]``."""
    wv = w if p.transpose_weight else w.t()                              # [N, K]
    x2 = x.reshape(-1, x.shape[-1])
    if x.dtype == torch.bfloat16 and not _bf16_inner_product():
        # no bf16 inner product here: the fp32 GEMM over widened operands (the weight
        # widened per call, not kept: a bf16 model keeps its bf16 memory), the one
        # rounding after the activation -- the op's definition
        y = torch.ops.mkldnn._linear_pointwise(x2.float(), wv.float(),
                                               None if b is None else b.float(), "none", [], "")
        return _activate(p, y).to(x.dtype).reshape(*x.shape[:-1], wv.shape[0])
    if x.dtype == torch.bfloat16:  # a bf16 inner product: its post-op rounds once
        post, algo = POST_OPS[p.activation_type]
        y = torch.ops.mkldnn._linear_pointwise(x2, wv, b, post, [], algo)
        return _finite_or_composite(p, x, w, b, y.reshape(*x.shape[:-1], wv.shape[0]))
    y = torch.ops.mkldnn._linear_pointwise(x2, wv, b, "none", [], "")    # [M, N] fp32
    return _activate(p, y).reshape(*x.shape[:-1], wv.shape[0])


def _activate(p: Any, y: torch.Tensor) -> torch.Tensor:
    """The activation over the fp32 GEMM result ``y`` as the unfused graph's
    activation op applies it (the C kernel for the built-in formulas, in place; a
    plugin's re-registered activation its own function)."""
    from ...ops.activation import get_activation
    from ..cpu_kernels import torch_ops as ck
    from .activation import c_activation

    act = get_activation(p.activation_type, "LinearActivation")
    name, why = c_activation(act)
    if not (why or ck.why_not(y)):
        return ck.activation(y, name, out=y)
    return act.torch(y)


def _finite_or_composite(p: Any, x: torch.Tensor, w: torch.Tensor, b: Any,
                         y: torch.Tensor) -> torch.Tensor:
    """``y`` (of oneDNN's bf16 GELU post-op), redone by the composite kernel when it
    holds a NaN/Inf (one sum over it): that post-op turns +-inf into NaN where the
    op's formula gives +-inf or 0, and NaN inputs must propagate as the reference's
    arithmetic does."""
    if math.isfinite(float(y.sum())):
        return y
    from .fused import composite_linear_activation

    return composite_linear_activation(p, {"x": x, "weight": w, "bias": b})


def bind_dnnl_linear_activation(p: Any, ins: dict[str, Any], outs: list, ctx: Any
                                ) -> Callable[[list], None] | None:
    """The bound call: the GEMM's result becomes the output (its slot filled per run);
    None where oneDNN does not take the call or the output is a planned buffer."""
    x, w, b = ins["x"], ins["weight"], ins.get("bias")
    out = outs[0]
    if type(out) is not Slot or ins.get("scale") is not None or why_not_dnnl(p, x, w, b):
        return None
    ctx.note_layout("weight", "[out, in] rows (oneDNN)")
    ctx.note_torch_pool()
    gx, i = getter(x), out.index

    def call(env: list) -> None:
        env[i] = dnnl_linear_activation(p, gx(env), w, b)
    return call


bind_dnnl_linear_activation.fills_slots = True  # type: ignore[attr-defined]
