"""The NPU part of ``atb info``: torch_npu's version, the CANN version, the SoC and
whether the NNAL package (the ``_npu_*`` ATB ops) is there -- read through
:func:`atbcore.backends.npu.npu_module`, so a test's torch_npu double is reported too.
Each query that fails is reported as such; none stops ``atb info``."""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["npu_runtime", "npu_line"]


def _ask(fn: Callable[[], Any]) -> tuple[Any, str]:
    try:
        return fn(), ""
    except Exception as e:  # a half-installed CANN must not break `atb info`
        return None, f"{type(e).__name__}: {e}"


def _cann_version(mod: Any) -> Any:
    utils = getattr(mod.npu, "utils", None)
    if utils is not None and hasattr(utils, "get_cann_version"):
        return utils.get_cann_version(module="CANN")
    import torch

    return getattr(torch.version, "cann", None) or "unknown"


def npu_runtime() -> dict:
    """``{"available": False, "reason": ...}`` without torch_npu; else torch_npu's
    version, ``cann``, ``soc_version`` (int), ``soc_family`` (A2, A3, 310P ...),
    ``device_name``, ``device_count`` and ``nnal`` / ``nnal_detail``."""
    from ..backends.npu import nnal_reason, npu_module, soc_family, unavailable_reason

    why = unavailable_reason()
    if why:
        return {"available": False, "reason": why}
    mod, err = _ask(npu_module)
    if mod is None:
        return {"available": False, "reason": f"import torch_npu failed ({err})"}
    info: dict = {"available": True, "torch_npu": getattr(mod, "__version__", "unknown")}
    for key, fn in (("cann", lambda: _cann_version(mod)),
                    ("soc_version", lambda: int(mod.npu.get_soc_version())),
                    ("soc_family", soc_family),
                    ("device_name", lambda: mod.npu.get_device_name(0)),
                    ("device_count", lambda: int(mod.npu.device_count()))):
        val, err = _ask(fn)
        info[key] = val if not err else f"unknown ({err})"
    nnal = nnal_reason()
    info["nnal"], info["nnal_detail"] = nnal is None, nnal or "libatb.so found"
    return info


def npu_line(npu: dict) -> str:
    """One line of ``atb info``'s table output."""
    if not npu["available"]:
        return f"NPU (torch_npu): no ({npu['reason']})"
    return (f"NPU (torch_npu {npu['torch_npu']}): CANN {npu['cann']}, SoC {npu['device_name']} "
            f"({npu['soc_family']}, soc_version {npu['soc_version']}), {npu['device_count']} "
            f"device(s); NNAL ATB ops: {'yes' if npu['nnal'] else 'no'} ({npu['nnal_detail']})")
