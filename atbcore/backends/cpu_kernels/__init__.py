"""One-kernel CPU implementations of the hot fused ops, in plain C.

Why plain C through ctypes, and not Inductor or a torch C++ extension (measured on
this 2-core x86-64 machine, torch 2.13, RMSNorm of one 4096-wide row, this thread's
CPU time, one torch thread):

=========================  ===================  ==================
generator                  build                call, 1 row
=========================  ===================  ==================
plain C + ctypes (this)    ~1 s CPU, once       3.6 us
torch C++ extension        91 s (torch headers) 2.2 us dispatcher
                                                + the same kernel
Inductor (torch.compile)   13-32 s per region   24 us (guards,
                           (cache per process   wrapper)
                           tree, per shape)
torch eager composite      -                    12 us (6 aten ops)
=========================  ===================  ==================

* the C sources compile once per machine and user and are cached by source hash,
  compiler and flags (:mod:`.build`); a torch upgrade never breaks them (no ABI);
* one ctypes call with one packed argument block costs ~1 us (30 separate ctypes
  arguments cost ~6.5 us, measured), so the per-call cost is mostly the tensor
  attribute reads and the output allocation;
* the kernels are row loops the compiler vectorises: AVX-512 (x86-64-v4) where
  ``/proc/cpuinfo`` has it, AVX2 + FMA + F16C (v3) else, a generic build as the
  fallback; fp32 math, one rounding per output. Norms, RoPE, activations and softmax
  are single-threaded; the decode matmul (``linear_rows``: on ``[N, K]`` rows
  bandwidth-bound rows up to 4, 4 x 4 register tiles up to 32; on 32-output panels
  8 x 32 broadcast tiles at any row count) and cache attention (``decode_attention``,
  ``paged_decode_attention`` reading the blocks in place) split their work over a
  small pthread pool (``csrc/pool.c``: chunks claimed by compare-and-swap, the caller
  working too, a back-off to one thread when a worker is late on a busy machine).
  Not OpenMP: a second runtime beside torch's would fight it for the cores. Even
  torch's own OpenMP workers spin after each parallel op and then hold the core the
  pool needs, so the decode steps that run these kernels park torch's pool at one
  thread (``threads.parked_torch_threads``; measured: the fp32 LM head 3.1 ms
  after an SDPA call, 1.9 ms alone).

:mod:`.torch_ops` calls them on torch CPU tensors; :mod:`.native` reads any
framework's CPU tensor (NumPy, DLPack producers, MindSpore) as address, shape, strides
and dtype without a copy, :mod:`.native_ops` runs the kernels on such views and
:mod:`.native_kernels` turns them into the ``numpy_c``, MindSpore and Paddle
backends' kernels; :mod:`.counting` counts launches (aten ops plus C calls). ``ATB_CPU_KERNELS=0`` turns them off (the torch
composites run, logged); ``ATB_CPU_ISA`` / ``ATB_CPU_KERNELS_CACHE`` / ``CC`` steer
the build.
"""

from __future__ import annotations

from .bindings import build_info, library, unavailable_reason

__all__ = ["available", "unavailable_reason", "build_info", "library"]


def available() -> bool:
    """True when the C kernels are built and loaded (building them on first use)."""
    return library() is not None
