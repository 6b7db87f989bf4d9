"""``init(...)`` and ``check_compatibility()``: process-wide runtime settings."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import ParamsError
from ..log import set_log_level

__all__ = ["RuntimeConfig", "init", "get_config", "check_compatibility", "package_version",
           "SUPPORTED"]

_ALLOCATORS = ("pool", "naive")


@dataclass(frozen=True)
class RuntimeConfig:
    device_id: int = 0
    log_level: str = "WARNING"
    enable_profiling: bool = False
    allocator_type: str = "pool"
    stream_id: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


_CONFIG = RuntimeConfig()


def init(device_id: int = 0, log_level: str = "WARNING", enable_profiling: bool = False,
         allocator_type: str = "pool", stream_id: int = 0, **extra: Any) -> int:
    """Configure the runtime. Returns 0 (the seed articles check ``status != 0``);
    invalid settings raise :class:`ParamsError`."""
    global _CONFIG
    if allocator_type not in _ALLOCATORS:
        raise ParamsError("init", "allocator_type", " or ".join(_ALLOCATORS), repr(allocator_type))
    if not isinstance(device_id, int) or device_id < 0:
        raise ParamsError("init", "device_id", "an int >= 0", repr(device_id))
    level = str(log_level).upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ParamsError("init", "log_level", "DEBUG/INFO/WARNING/ERROR", repr(log_level))
    set_log_level(level)
    _CONFIG = replace(_CONFIG, device_id=device_id, log_level=level,
                      enable_profiling=bool(enable_profiling), allocator_type=allocator_type,
                      stream_id=stream_id, extra=dict(extra))
    return 0


def get_config() -> RuntimeConfig:
    return _CONFIG


def package_version(dist: str) -> str | None:
    """Installed version of a distribution, or None, without importing it."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# Supported ranges: (lowest, first unsupported or None); pyproject.toml's dependency
# ranges say the same (tests/core/test_supported_ranges.py checks that they agree).
SUPPORTED: dict[str, tuple[str, str | None]] = {
    "numpy": ("1.24", None), "torch": ("2.4", "3"), "mindspore": ("2.3", "3"),
    "paddlepaddle": ("3.0", "4"), "transformers": ("5.0", "6"),
    "sentence-transformers": ("6.2", "7")}


def _vtuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split("."):
        num = "".join(ch for ch in part if ch.isdigit())
        if not num:
            break
        out.append(int(num))
    return tuple(out)


def check_compatibility() -> dict[str, Any]:
    """Check installed framework versions against what atb supports.

    Returns ``{"compatible": bool, "python": ..., "packages": {name: version|None},
    "problems": [...]}``; never raises for a missing optional framework.
    """
    packages = {name: package_version(name) for name in SUPPORTED}
    packages["torch_npu"] = package_version("torch_npu")
    problems = []
    for name, (lowest, beyond) in SUPPORTED.items():
        v = packages.get(name)
        if v is not None and _vtuple(v) < _vtuple(lowest):
            problems.append(f"{name} {v} is older than the supported minimum {lowest}")
        elif v is not None and beyond is not None and _vtuple(v) >= _vtuple(beyond):
            problems.append(f"{name} {v} is newer than the supported range (< {beyond})")
    if packages["torch_npu"] and packages["torch"]:
        tv, nv = _vtuple(packages["torch"])[:2], _vtuple(packages["torch_npu"])[:2]
        if tv != nv:
            problems.append(f"torch_npu {packages['torch_npu']} does not match torch "
                            f"{packages['torch']} (major.minor must agree)")
    return {"compatible": not problems, "python": platform.python_version(),
            "packages": packages, "problems": problems}
