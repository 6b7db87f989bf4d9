"""torch_npu: the module behind the torch backend's NPU kernels, and the SoC facts the
kernels' capability checks read.

``npu_module()`` is ``torch_npu`` (imported on first use). Tests install a stand-in
with :func:`use_npu_module` (a conformance double checking every documented argument
constraint); nothing else can replace it, and no module of atb is importable as
``torch_npu``. Facts and constraints: ``reference/torch_npu.md`` (op-plugin docs).

``use_npu_module(double, stand_in="cpu")`` also lets CPU tensors stand for NPU ones:
while it is active the torch backend routes CPU calls to the NPU kernels
(:func:`kernel_device`) and the CPU-only C kernels step aside, so ``compile()`` and
``LLM`` run end to end through the double on a machine without an NPU.
:func:`stand_in` does the same for another device type: ``stand_in("cuda")`` routes
CPU calls to the CUDA kernels (Triton, run by its interpreter under
``TRITON_INTERPRET=1``), which is how CI checks what a model binds on a GPU.

The ``_npu_*`` ATB ops (``_npu_reshape_and_cache``, ``_npu_paged_attention``) are
loaded lazily by torch_npu from the separate NNAL package (``libatb.so``):
:func:`nnal_reason` says why they cannot run.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from typing import Any, Iterator

__all__ = ["npu_module", "use_npu_module", "unavailable_reason", "soc_family", "SOC_RANGES",
           "nnal_reason", "kernel_device", "stand_in", "stand_in_device", "into_out"]

_OVERRIDE: list[Any] = []
# (device type whose tensors stand in, the device type they stand for), innermost last
_STAND_IN: list[tuple[str, str]] = []

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
def use_npu_module(module: Any, stand_in: str | None = None) -> Iterator[Any]:
    """Run the NPU kernels against ``module`` instead of torch_npu (tests);
    ``stand_in="cpu"``: CPU tensors stand for NPU ones meanwhile."""
    _OVERRIDE.append(module)
    _FAMILY.clear()
    entry = None if stand_in is None else (stand_in, "npu")
    if entry is not None:
        _STAND_IN.append(entry)
    try:
        yield module
    finally:
        _OVERRIDE.remove(module)
        if entry is not None:
            _STAND_IN.remove(entry)
        _FAMILY.clear()


@contextlib.contextmanager
def stand_in(device: str, by: str = "cpu") -> Iterator[None]:
    """Meanwhile tensors on ``by`` stand for tensors on ``device`` ("npu", "cuda"):
    the torch backend routes their calls to ``device``'s kernels (:func:`kernel_device`)
    and the CPU-only C kernels step aside (tests on a machine without the device)."""
    entry = (by, device)
    _STAND_IN.append(entry)
    try:
        yield
    finally:
        _STAND_IN.remove(entry)


def stand_in_device() -> str | None:
    """The device type standing for another's tensors (a test's stand-in), or None."""
    return _STAND_IN[-1][0] if _STAND_IN else None


def kernel_device(device_type: str) -> str:
    """The device type whose kernels serve tensors on ``device_type``: the device a
    stand-in (:func:`stand_in`) makes them stand for, else ``device_type`` itself."""
    for by, device in reversed(_STAND_IN):
        if device_type == by:
            return device
    return device_type


def nnal_reason() -> str | None:
    """Why the ``_npu_*`` ATB ops cannot run (None = the NNAL package is set up):
    torch_npu loads them from ``libatb.so``, found through ``ATB_HOME_PATH`` (set by
    NNAL's ``atb/set_env.sh``). A double says for itself (its ``nnal`` attribute)."""
    why = unavailable_reason()
    if why:
        return why
    said = getattr(_OVERRIDE[-1], "nnal", None) if _OVERRIDE else None
    if said is not None:
        return None if said else "the NNAL package (libatb.so) is not installed"
    home = os.environ.get("ATB_HOME_PATH")
    if not home:
        return ("the _npu_* ATB ops need the NNAL package (libatb.so): ATB_HOME_PATH is not "
                "set (source nnal/atb/set_env.sh)")
    if not os.path.isfile(os.path.join(home, "lib", "libatb.so")):
        return f"the _npu_* ATB ops need libatb.so; not found under ATB_HOME_PATH={home}/lib"
    return None


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


def into_out(out: list | None, i: int, y: Any) -> Any:
    """``y`` as a kernel's output ``i``: copied into ``out[i]`` when the caller gave a
    buffer there (the op's result was made by torch_npu, which writes its own)."""
    o = None if not out or i >= len(out) else out[i]
    return y if o is None or o is y else o.copy_(y)


def _register_fusion_choices() -> None:
    """What the NPU's fused ops prefer the pass pipeline to leave apart
    (:mod:`atbcore.backends.fusion_choices`)."""
    from ..fusion_choices import prefer_unfused

    add_norm = ("torch_npu has no GEMM epilogue: the residual add stays a node so that "
                "add_rmsnorm makes it npu_add_rms_norm with the norm after it")
    prefer_unfused("npu", "linear_residual", add_norm)
    prefer_unfused("npu", "ffn_residual", add_norm)
    prefer_unfused("npu", "norm_ffn", "the norm after a residual add stays a node so that "
                   "add_rmsnorm makes the two one npu_add_rms_norm")
    prefer_unfused("npu", "rope_cache", "torch_npu has no RoPE with the cache write: "
                   "npu_rotary_mul and the reshape-and-cache op run apart")


_register_fusion_choices()
