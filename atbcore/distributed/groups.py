"""Process groups and the collective backend per device, in one place.

A collective op's ``group`` param is ``None`` (the default group), a
``torch.distributed`` ProcessGroup object, or the name a group was registered
under with :func:`register_group` (a name survives saving a graph; an object does
not)::

    import torch.distributed as dist
    from atbcore.distributed import init_distributed, register_group
    init_distributed(rank, world_size, "file:///tmp/store", device="cpu")   # gloo
    register_group("tp", dist.new_group([0, 1]))
    Builder().build_operation("AllGather", {"group": "tp", "axis": -1})

torch is looked up only when something already imported it, so the core stays
framework-free; without torch.distributed every group has one process.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
from typing import Any

from ..errors import CapabilityError, ParamsError

__all__ = ["BACKEND_BY_DEVICE", "backend_for_device", "group_rank", "group_size",
           "init_distributed", "register_group", "resolve_group", "unregister_group"]

# device type -> the torch.distributed backend that moves its tensors
BACKEND_BY_DEVICE = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}

_GROUPS: dict[str, Any] = {}
_LOCK = threading.Lock()


def _dist() -> Any:
    """``torch.distributed`` when torch is already imported and it is initialised."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def _backend_missing(backend: str) -> str | None:
    """Why ``backend`` cannot run here (None: it can)."""
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if backend == "gloo":
        return None if dist.is_gloo_available() else "torch was built without gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            return "no CUDA device"
        return None if dist.is_nccl_available() else "torch was built without nccl"
    if backend == "hccl":
        if importlib.util.find_spec("torch_npu") is None:
            return "torch_npu is not installed (it provides hccl)"
        return None
    return f"unknown backend {backend!r}"


def backend_for_device(device: str) -> str:
    """The torch.distributed backend for tensors on ``device`` ("cpu", "cuda:1",
    "npu" ...): gloo, nccl or hccl; CapabilityError when it cannot run here."""
    kind = str(device).split(":")[0]
    backend = BACKEND_BY_DEVICE.get(kind)
    if backend is None:
        raise CapabilityError("distributed", f"no collective backend for device {device!r}",
                              f"one of {sorted(BACKEND_BY_DEVICE)}", repr(device))
    why = _backend_missing(backend)
    if why:
        raise CapabilityError("distributed", f"backend {backend} for device {device}",
                              f"{backend} available", why)
    return backend


def init_distributed(rank: int, world_size: int, init_method: str, device: str = "cpu",
                     timeout: float | None = None) -> str:
    """Initialise the default process group with the backend ``device`` needs;
    returns the backend name. Already initialised: checks rank and size match.
    ``timeout``: seconds a collective may wait for a peer (None: torch's default)."""
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        given = (dist.get_rank(), dist.get_world_size())
        if given != (rank, world_size):
            raise ParamsError("init_distributed", "rank and world size of the running group",
                              (rank, world_size), given)
        return str(dist.get_backend())
    backend = backend_for_device(device)
    kw = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            **kw)
    return backend


def register_group(name: str, group: Any) -> None:
    """Make ``group`` (a ProcessGroup) reachable from op params as ``group=name``."""
    if not isinstance(name, str) or not name:
        raise ParamsError("register_group", "group name", "a non-empty string", repr(name))
    with _LOCK:
        _GROUPS[name] = group


def unregister_group(name: str) -> None:
    """Forget a registered group name (a no-op for unknown names)."""
    with _LOCK:
        _GROUPS.pop(name, None)


def resolve_group(group: Any, op: str = "distributed") -> Any:
    """The ProcessGroup ``group`` stands for (None: the default group)."""
    if group is None:
        return None
    if isinstance(group, str):
        with _LOCK:
            found = _GROUPS.get(group)
        if found is None:
            raise ParamsError(op, f"process group {group!r} is not registered",
                              f"one of {sorted(_GROUPS)} (atbcore.distributed.register_group)",
                              repr(group))
        return found
    return group


def group_size(group: Any = None, op: str = "distributed") -> int:
    """Processes in ``group`` (1 when torch.distributed is not initialised)."""
    dist = _dist()
    pg = resolve_group(group, op)
    if dist is None:
        return 1
    return int(dist.get_world_size(pg) if pg is not None else dist.get_world_size())


def group_rank(group: Any = None, op: str = "distributed") -> int:
    """This process's rank in ``group`` (0 when torch.distributed is not initialised)."""
    dist = _dist()
    pg = resolve_group(group, op)
    if dist is None:
        return 0
    return int(dist.get_rank(pg) if pg is not None else dist.get_rank())
