"""``atb.init``, ``atb.check_compatibility`` and ``atb.KVCache`` for PyTorch users.

``init`` is the core's (log level, profiling, allocator) plus the device: with CUDA
``device_id`` selects the GPU (``torch.cuda.set_device``); an ``npu`` device is
refused with an AtbError until NPU kernels exist; on a CPU-only machine only
``device_id=0`` exists. ``check_compatibility`` adds torch's view (version, CUDA,
NPU, devices, the registered ``torch.ops.atb`` ops) to the core report.
"""

from __future__ import annotations

from typing import Any

import torch

from atbcore.errors import CapabilityError, DeviceError
from atbcore.memory import KVCache as _CoreKVCache
from atbcore.runtime.config import check_compatibility as _core_compat
from atbcore.runtime.config import init as _core_init

from .devices import accelerator_devices, npu_available, resolve_device, torch_npu_importable
from .library import OPS

__all__ = ["init", "check_compatibility", "KVCache"]


def init(device_id: int = 0, log_level: str = "WARNING", enable_profiling: bool = False,
         allocator_type: str = "pool", *, device: Any = None, **extra: Any) -> int:
    """Configure atb for this process; returns 0 (the seeds check ``status != 0``).

    ``enable_profiling=True`` makes every GraphOp record per-node times and every
    standalone module call its time (export with :func:`atb_torch.export_chrome_trace`).
    ``device`` ("cpu", "cuda:1", "npu" ...) is checked; ``device_id`` picks the GPU."""
    if device is not None:
        dev = resolve_device(device, "init")  # npu: the ops with torch_npu kernels run there
        if dev.type == "cuda" and dev.index is not None:
            device_id = dev.index
    status = _core_init(device_id=device_id, log_level=log_level,
                        enable_profiling=enable_profiling, allocator_type=allocator_type, **extra)
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        if device_id >= n:
            raise DeviceError("init", "device_id", f"0..{n - 1} (CUDA devices)", device_id)
        torch.cuda.set_device(device_id)
    elif device_id != 0:
        raise DeviceError("init", "device_id", "0 (no CUDA or NPU device on this machine)",
                          device_id)
    return status


def check_compatibility() -> dict[str, Any]:
    """The core report (``compatible``, ``packages``, ``problems`` ...) plus a
    ``torch`` section: version, CUDA, NPU, devices and the custom ops."""
    report = _core_compat()
    report["torch"] = {
        "version": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda_version": torch.version.cuda,
        "torch_npu_installed": torch_npu_importable(),
        "npu_available": npu_available(),
        "npu_kernels": False,  # the torch_npu backend is a separate piece of work
        "devices": accelerator_devices(),
        "custom_ops": sorted(f"atb::{n}" for n in OPS),
        "compile": hasattr(torch, "compile"),
    }
    return report


class KVCache(_CoreKVCache):
    """The core's contiguous KV cache, also taking torch dtypes and devices:
    ``atb.KVCache(num_layers, max_batch, max_seq_len, num_kv_heads, head_dim,
    dtype=torch.float16, device="cuda")``."""

    def __init__(self, num_layers: int, max_batch: int, max_seq_len: int, num_kv_heads: int,
                 head_dim: int, dtype: Any = torch.float16, device: Any = "cpu",
                 pool: Any = None) -> None:
        dev = resolve_device(device, "KVCache")
        if dev.type == "npu":
            raise CapabilityError("KVCache", "NPU caches (torch_npu backend) are not implemented "
                                  "yet", "device cpu or cuda", str(dev))
        super().__init__(num_layers, max_batch, max_seq_len, num_kv_heads, head_dim,
                         dtype=dtype, device=str(dev), pool=pool)
