"""torch_npu: the module behind the torch backend's NPU kernels, and the SoC facts the
kernels' capability checks read.

``npu_module()`` is ``torch_npu`` (imported on first use). Tests install a stand-in
with :func:`use_npu_module` (a conformance double checking every documented argument
constraint); nothing else can replace it, and no module of atb is importable as
``torch_npu``. Facts and constraints: ``reference/torch_npu.md`` (op-plugin docs).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from typing import Any, Iterator

__all__ = ["npu_module", "use_npu_module", "unavailable_reason", "soc_family", "SOC_RANGES"]

_OVERRIDE: list[Any] = []

# torch_npu.npu.get_soc_version() ranges -> the family the op docs name
SOC_RANGES = (((100, 104), "910"), ((200, 205), "310P"), ((220, 225), "A2"),
              ((240, 243), "310B"), ((250, 256), "A3"), ((260, 260), "950"))


def unavailable_reason() -> str | None:
    """Why there is no torch_npu to call (None = there is)."""
    if _OVERRIDE:
        return None
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed"
    return None


def npu_module() -> Any:
    """The torch_npu module (or the stand-in a test installed)."""
    if _OVERRIDE:
        return _OVERRIDE[-1]
    return importlib.import_module("torch_npu")


@contextlib.contextmanager
def use_npu_module(module: Any) -> Iterator[Any]:
    """Run the NPU kernels against ``module`` instead of torch_npu (tests)."""
    _OVERRIDE.append(module)
    _FAMILY.clear()
    try:
        yield module
    finally:
        _OVERRIDE.remove(module)
        _FAMILY.clear()


_FAMILY: dict[str, str] = {}


def soc_family() -> str:
    """"A2", "A3", "310P", "910", "310B", "950" or "unknown" (cached per module)."""
    hit = _FAMILY.get("soc")
    if hit is not None:
        return hit
    version = int(npu_module().npu.get_soc_version())
    fam = next((name for (lo, hi), name in SOC_RANGES if lo <= version <= hi), "unknown")
    _FAMILY["soc"] = fam
    return fam
