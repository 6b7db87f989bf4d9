"""ctypes bindings of the C kernels, and the hook that makes their calls countable.

Every entry point takes one argument: the address of a block of 8-byte fields
(``int64`` for ints and addresses, ``double`` for floats) that the caller packs
with :mod:`struct`. One packed ``bytes`` argument costs ~1 us per call where
30 separate ctypes arguments cost ~6.5 us (measured here), and a ``bytes`` is
immutable and private to the call, so calls are thread-safe.

:func:`library` builds/loads the library once (thread-safe) and returns
``None`` with :func:`unavailable_reason` saying why when it cannot.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Callable

from ...log import logger
from ..npu import kernel_device, stand_in_device
from .build import BuildResult, build_library, check_private

__all__ = ["library", "unavailable_reason", "build_info", "entry", "pool_stats", "SINKS",
           "ENTRY_POINTS", "RECORDING", "NotNative", "not_native", "run_steps",
           "run_steps_timed", "entry_names", "use_omp_team"]

ENTRY_POINTS = ("atb_rms_norm", "atb_layer_norm", "atb_rope", "atb_activation", "atb_softmax",
                "atb_linear_rows", "atb_decode_attention", "atb_decode_attention_i8",
                "atb_reshape_and_cache", "atb_reshape_and_cache_i8",
                "atb_argmax", "atb_prefill_attention", "atb_mt19937_uniforms",
                "atb_sample_top_k", "atb_repetition_penalty", "atb_linear_w4", "atb_gather_rows",
                "atb_linear_w8a8")

# Lists that record C kernel calls while a LaunchCounter is active (a stack:
# counters may nest). Kernel wrappers append their name to the innermost one.
SINKS: list[list[str]] = []

# Threads recording the C calls they make (thread id -> list of (entry address,
# argument block)): a bound program records a run of bound calls once and then
# makes them as one native call (runtime/native_run.py).
RECORDING: dict[int, list[tuple[int, bytes]]] = {}
_ident = threading.get_ident


class NotNative(Exception):
    """Raised in a bound call that is being recorded when this run of it needs more
    than its C calls (a torch fallback, a per-call value check): the program runs
    that call through Python."""


def not_native() -> None:
    """Say, in a bound call's path that is not its recorded C calls alone, that this
    run cannot be recorded (raises :class:`NotNative` while this thread records)."""
    if RECORDING and _ident() in RECORDING:
        raise NotNative()


_LOCK = threading.Lock()
_STATE: dict[str, object] = {}


def _load() -> None:
    if os.environ.get("ATB_CPU_KERNELS", "1").strip().lower() in ("0", "off", "false", "no"):
        _STATE.update(lib=None, reason="disabled by ATB_CPU_KERNELS=0",
                      build=BuildResult(None, "", "disabled"))
        return
    res = build_library()
    _STATE["build"] = res
    if res.path is None:
        _STATE.update(lib=None, reason=res.reason)
        logger.info("CPU kernels unavailable: %s; the torch composites run instead", res.reason)
        return
    try:
        # loading runs the library's constructors: check it (and its directory) once
        # more right before, as build.py did when it chose it
        check_private(res.path.parent)
        check_private(res.path, "file")
    except OSError as e:
        _STATE.update(lib=None, reason=f"the C kernel library was refused ({e})")
        logger.warning("CPU kernels unavailable: %s; the torch composites run instead",
                       _STATE["reason"])
        return
    try:
        lib = ctypes.CDLL(str(res.path))
        for name in ENTRY_POINTS:
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_char_p]
            fn.restype = ctypes.c_int64
        for name in ("atb_run_steps", "atb_run_steps_timed"):
            getattr(lib, name).argtypes = [ctypes.c_void_p] * (1 + name.endswith("timed"))
            getattr(lib, name).restype = ctypes.c_int64
        lib.atb_pool_stats.argtypes = [ctypes.POINTER(ctypes.c_int64)]
        lib.atb_pool_stats.restype = ctypes.c_int64
        lib.atb_pool_use_omp_team.argtypes = [ctypes.c_int64]
        lib.atb_pool_use_omp_team.restype = ctypes.c_int64
    except (OSError, AttributeError) as e:
        _STATE.update(lib=None, reason=f"the built C kernels did not load ({e})")
        logger.info("CPU kernels unavailable: %s", _STATE["reason"])
        return
    _STATE.update(lib=lib, reason=None)
    if res.compiled:
        logger.info("CPU kernels built for %s in %.1f s: %s", res.isa, res.seconds, res.path)


def library() -> ctypes.CDLL | None:
    """The loaded library (building it on first use), or None."""
    if "lib" not in _STATE:
        with _LOCK:
            if "lib" not in _STATE:
                _load()
    return _STATE["lib"]  # type: ignore[return-value]


def unavailable_reason() -> str | None:
    """Why the C kernels cannot run here (None when they can)."""
    library()
    if stand_in_device() == "cpu":  # CPU tensors stand for a device's (a test stand-in)
        return f"CPU tensors stand for {kernel_device('cpu').upper()} tensors (a test stand-in)"
    return _STATE["reason"]  # type: ignore[return-value]


def build_info() -> BuildResult:
    """How the library was obtained (ISA, path, whether this process compiled it)."""
    library()
    return _STATE["build"]  # type: ignore[return-value]


def use_omp_team(on: bool) -> bool:
    """Whether the C kernels' big jobs (prefill-sized matmuls) may run on torch's
    OpenMP team when torch is loaded (the default): right where torch runs the
    framework's ops (its workers spin after each op and would hold atb's cores), wrong
    where another framework does (MindSpore, Paddle), whose threads then hold the
    cores that team needs: there atb's own pool takes them. Returns the previous
    setting (True where the library is unavailable)."""
    lib = library()
    return True if lib is None else bool(lib.atb_pool_use_omp_team(1 if on else 0))


def pool_stats() -> dict[str, int]:
    """Counters of the C kernels' thread pool since the library loaded: jobs split
    across threads, jobs run on the caller alone because of a back-off, back-offs
    (a worker came late, so the next jobs ran single-threaded), workers started, and
    prefill-sized jobs run on the process's OpenMP team (torch's) instead."""
    keys = ("parallel_jobs", "backoff_jobs", "backoffs", "workers", "team_jobs")
    lib = library()
    if lib is None:
        return dict.fromkeys(keys, 0)
    out = (ctypes.c_int64 * len(keys))()
    lib.atb_pool_stats(out)
    return dict(zip(keys, out))


def entry(name: str) -> Callable[[bytes], int]:
    """A counted caller of the C entry point ``atb_<name>``: ``call(packed_args) -> status``."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"CPU kernels unavailable: {unavailable_reason()}")
    fn = getattr(lib, f"atb_{name}")
    addr = ctypes.cast(fn, ctypes.c_void_p).value

    def call(args: bytes) -> int:
        if SINKS:
            SINKS[-1].append(name)
        if RECORDING:
            rec = RECORDING.get(_ident())
            if rec is not None:  # noted for the program's native runs (and made now)
                rec.append((addr, args))
        return fn(args)

    call.__name__ = f"atb_{name}"
    return call


def run_steps(table: object) -> int:
    """``atb_run_steps(table)`` (csrc/program.c): recorded C calls made in one call."""
    return library().atb_run_steps(table)  # type: ignore[union-attr]


def run_steps_timed(table: object, ns: object) -> int:
    """:func:`run_steps` that writes each step's wall time in ns to ``ns[step]`` (a
    ``c_int64`` array as long as the table's steps; a diagnostic)."""
    return library().atb_run_steps_timed(table, ns)  # type: ignore[union-attr]


def entry_names() -> dict[int, str]:
    """Entry point address -> name (``atb_...``), to read a recorded table."""
    lib = library()
    if lib is None:
        return {}
    return {ctypes.cast(getattr(lib, n), ctypes.c_void_p).value or 0: n for n in ENTRY_POINTS}
