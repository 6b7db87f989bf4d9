"""Helpers shared by the Paddle kernels: fp32 compute for half types, device kinds,
and the choice between a Paddle fused op and a composition of plain ops.

Which fused ops Paddle 3.3.1 (CPU wheel) registers, measured on this build:

=====================================  ===========  =========================================
op                                     CPU          used for
=====================================  ===========  =========================================
fused_rms_norm (+ residual)            fp32         RmsNorm, AddRmsNorm
fused_layer_norm (+ residual)          fp32         AddLayerNorm
swiglu (one or two inputs)             fp32         SwiGLU, FusedFeedForward (swiglu)
F.scaled_dot_product_attention         fp32 (math)  FlashAttention without a built mask
fused_rotary_position_embedding        none (GPU)   RoPE on GPU (half style, full rotary)
fused_bias_act, fused_linear,          none (GPU)   not used: see the kernels' notes
variable_length_memory_efficient_attn  none (GPU)
weight_only_linear                     none (GPU)   not used: needs weight_quantize's layout
=====================================  ===========  =========================================

fp16/bf16 matmul, layer_norm, silu, gelu, exp (bf16) ... have no CPU kernels either,
so half inputs are upcast once, computed in fp32 and rounded once, which is also the
numerics contract. A fused op that turns out not to be registered on a build (a
``NotFound`` RuntimeError) is remembered per (op, device, dtype), logged once at INFO
with the reason, and the composition runs instead.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from typing import Any, Callable

import paddle

from atbcore.log import logger

__all__ = ["HALF", "f32", "to_dtype", "device_kind", "fused_or", "fused_reason",
           "PATHS", "reset_paths", "FUSED_CPU_FP32", "fresh", "take", "clear_fused_cache"]

HALF = (paddle.float16, paddle.bfloat16)

# Fused ops with a CPU kernel in Paddle 3.3 (fp32 only); everything else fused is GPU-only.
FUSED_CPU_FP32 = frozenset({"fused_rms_norm", "fused_layer_norm", "swiglu"})
# Paddle 3.3's CPU kernels of these (RmsNormAvxKernel, ...) use AVX-512 instructions
# whatever the CPU: on one without AVX-512F the process dies of SIGILL.
FUSED_CPU_AVX512 = frozenset({"fused_rms_norm", "fused_layer_norm"})

#: (op, path) -> calls; tests and diagnostics read which path ran
PATHS: Counter = Counter()
_MISSING: dict[tuple[str, str, str], str] = {}
_LOCK = threading.Lock()


def reset_paths() -> None:
    """Forget the path counts (tests)."""
    PATHS.clear()


def clear_fused_cache() -> None:
    """Forget fused ops found missing at run time (tests)."""
    with _LOCK:
        _MISSING.clear()


def f32(t: Any) -> Any:
    """``t`` as fp32 (no copy when it already is; None stays None)."""
    if t is None or t.dtype == paddle.float32:
        return t
    return t.astype(paddle.float32)


def to_dtype(t: Any, dtype: Any) -> Any:
    """``t`` cast to ``dtype`` (the single rounding of a half result)."""
    return t if t.dtype == dtype else t.astype(dtype)


def device_kind(t: Any) -> str:
    """``cpu``, ``cuda`` or the custom device type of a tensor's place."""
    place = t.place
    if place.is_cpu_place():
        return "cpu"
    if place.is_gpu_place():
        return "cuda"
    s = str(place).lower()
    return s[len("place("):].split(":")[0].rstrip(")") if s.startswith("place(") else s


def fused_reason(name: str, t: Any) -> str | None:
    """Why the fused Paddle op ``name`` cannot take ``t`` (None = it can).

    CPU: only the ops in :data:`FUSED_CPU_FP32`, for fp32 data (callers upcast half
    inputs first); GPU: every op, unless one was found missing at run time."""
    kind = device_kind(t)
    key = (name, kind, str(t.dtype))
    if key in _MISSING:
        return _MISSING[key]
    if kind == "cpu":
        if name not in FUSED_CPU_FP32:
            return f"{name} has no CPU kernel in Paddle {paddle.__version__}"
        if t.dtype != paddle.float32:
            return f"{name} has only an fp32 CPU kernel, given {str(t.dtype)[7:]}"
        if name in FUSED_CPU_AVX512 and not _avx512():
            return f"{name}'s CPU kernel needs AVX-512F, which this CPU lacks"
        return None
    if kind != "cuda":
        return f"{name} is not known to run on {kind}"
    return None


@functools.lru_cache(maxsize=1)
def _avx512() -> bool:
    from atbcore.backends.cpu_kernels.build import cpu_flags

    return "avx512f" in cpu_flags()


def fused_or(op: str, name: str, probe: Any, fused: Callable[[], Any],
             composed: Callable[[], Any]) -> Any:
    """Run ``fused()`` when the Paddle fused op ``name`` can take ``probe`` (a tensor
    with the device and dtype it will see), else ``composed()``; records the path in
    :data:`PATHS` under ``op``. A fused op missing at run time is remembered."""
    why = fused_reason(name, probe)
    if why is None:
        try:
            out = fused()
        except RuntimeError as e:
            if "not registered" not in str(e) and "NotFound" not in str(e):
                raise
            key = (name, device_kind(probe), str(probe.dtype))
            why = f"{name} is not registered for {key[1]} {key[2][7:]}"
            with _LOCK:
                _MISSING[key] = why
            logger.info("%s: Paddle %s -> composition (%s)", op, name, why)
        else:
            PATHS[(op, name)] += 1
            return out
    PATHS[(op, "composed")] += 1
    return composed()


def fresh(t: Any) -> Any:
    """A new tensor with ``t``'s values: Paddle's transpose/slice/split may return
    views, and only Reshape may alias its input (the memory planner relies on it)."""
    return t.clone()


def take(x: Any, idx: Any, axis: int) -> Any:
    """``x`` indexed by the int tensor ``idx`` (any shape) along ``axis``; the result
    has ``idx``'s shape in place of ``axis``. Pure data movement, so fp16 travels as
    bf16 bits (Paddle 3.3 has no fp16 CPU gather)."""
    if x.dtype == paddle.float16:
        return take(x.view(paddle.bfloat16), idx, axis).view(paddle.float16)
    flat = idx.reshape([-1])
    if flat.dtype not in (paddle.int32, paddle.int64):
        flat = flat.astype(paddle.int64)
    y = paddle.gather(x, flat, axis=axis)
    shape = list(x.shape[:axis]) + list(idx.shape) + list(x.shape[axis + 1:])
    return y.reshape(shape)
