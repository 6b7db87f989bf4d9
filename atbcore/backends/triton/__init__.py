"""Triton kernels: the torch backend's fused kernels for CUDA tensors.

Kernels: RmsNorm / AddRmsNorm (:mod:`.norm`), the gated activations SwiGLU / GeGLU
(:mod:`.activation`), RoPE ("half" layout) fused with the KV-cache write
(:mod:`.rope_cache`) and decode paged attention with GQA and split-K
(:mod:`.paged`). Each module exposes plain launch functions on torch tensors; the
torch backend routes CUDA calls to them (:mod:`atbcore.backends.torch.triton_cuda`)
and runs its torch composite, logged with the reason, where they cannot run.

Triton is imported only when a kernel module is: importing this package costs
nothing on a machine without it. Under ``TRITON_INTERPRET=1`` (set before the kernel
modules are imported) the same kernels run on CPU tensors in Triton's interpreter,
which is how CI tests them.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

__all__ = ["unavailable_reason", "interpreting", "device_reason", "MIN_CAPABILITY"]

# Compute capability Triton needs: bf16 tensor-core dots need Ampere (sm_80)
MIN_CAPABILITY = {"bf16": (8, 0), "default": (7, 0)}


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def unavailable_reason() -> str | None:
    """Why Triton cannot be used in this process (None = it can)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'atb[cuda]')"
    return None


_CAPS: dict[Any, tuple[int, int]] = {}


def device_reason(t: Any) -> str | None:
    """Why the Triton kernels cannot take tensor ``t`` (None = they can): a CUDA
    tensor on a GPU of sufficient compute capability, or any tensor in interpreter
    mode."""
    why = unavailable_reason()
    if why:
        return why
    if interpreting():
        return None
    dev = t.device
    if dev.type != "cuda":
        return f"Triton kernels run on CUDA; tensor on {dev}"
    import torch

    if getattr(torch.version, "hip", None):
        return "Triton kernels here are tuned for NVIDIA GPUs; ROCm device"
    cap = _CAPS.get(dev.index)
    if cap is None:
        cap = _CAPS[dev.index] = torch.cuda.get_device_capability(dev)
    need = MIN_CAPABILITY["bf16" if t.dtype == torch.bfloat16 else "default"]
    if cap < need:
        return (f"compute capability {cap[0]}.{cap[1]} < {need[0]}.{need[1]} needed for "
                f"{str(t.dtype)[6:]}")
    return None
