"""One-kernel CPU implementations of the hot fused ops, in plain C.

Why plain C through ctypes (measured on this 2-core x86-64 machine, torch 2.13):

* build time: the four C sources compile with ``cc -O3`` in ~1 s, once per
  machine and user (cached by source hash and flags, see :mod:`.build`); a
  torch C++ extension with the same kernel took 91 s to compile (torch
  headers), and Inductor (``torch.compile`` of one RMSNorm region) 13 s cold;
* call overhead: a ctypes call with one packed argument block is ~1 us
  (a torch custom op's dispatcher call ~2.2 us, the Inductor-compiled
  function's guards and wrapper far more at one row), and the kernels need
  no torch ABI, so a torch upgrade never breaks them;
* the kernels themselves are simple row loops the compiler vectorises (AVX2 +
  FMA + F16C when the CPU has them, a generic build otherwise), compute in
  fp32 and round once, and are memory bound: one pass where the torch
  composites make three to eight.

:mod:`.torch_ops` calls them on torch CPU tensors; :mod:`.counting` counts
launches (aten ops plus C calls). Set ``ATB_CPU_KERNELS=0`` to turn them off.
"""

from __future__ import annotations

from .bindings import build_info, library, unavailable_reason

__all__ = ["available", "unavailable_reason", "build_info", "library"]


def available() -> bool:
    """True when the C kernels are built and loaded (building them on first use)."""
    return library() is not None
