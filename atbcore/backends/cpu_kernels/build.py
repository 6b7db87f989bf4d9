"""Compile the C kernels once per machine and user, and cache the library.

The sources in ``csrc/`` are plain C11 (no torch or Python headers), compiled one
process per file over the cores, then linked (~15 s on 2 cores). The library is cached under
``$ATB_CPU_KERNELS_CACHE`` (default ``$XDG_CACHE_HOME/atb/cpu_kernels`` or
``~/.cache/atb/cpu_kernels``) in a directory named by a hash of the sources,
the compiler (path, size, mtime) and the flags, so a changed source or
compiler rebuilds and an unchanged one loads in microseconds. Concurrent
processes each compile to a private temporary file and rename it into place
(atomic), so nobody loads a half-written library.

The cache is trusted only when nobody else could have written it: every directory
used is created 0700 and checked (a real directory owned by this user, not group-
or world-writable), and a library is checked the same way (a regular file) right
before it is loaded, since loading runs its constructors. A cache that fails the
check is refused with a logged reason and the library is built into a fresh
private temporary directory instead (or the torch composites run when that fails
too). A failed build leaves its compiler output and time in ``build-error.txt``;
that ISA is skipped for ``ATB_CPU_KERNELS_RETRY_S`` seconds (default 3600) and then
tried again, so a transient compiler failure does not downgrade the ISA for good.

Instruction set: on x86-64 the build targets ``x86-64-v4`` (AVX-512, 512-bit
vectors) when ``/proc/cpuinfo`` lists its flags, else ``x86-64-v3`` (AVX2 + FMA +
F16C), else the generic baseline, which is also the fallback when an ISA build
fails. Measured here (2 cores, activations over 11008 floats, ns/element, v4 vs
v3): SiLU 0.72 vs 1.38, GELU 2.0 vs 3.6; relu (memory bound) 0.10 vs 0.29.
``ATB_CPU_ISA=avx2`` caps the build at v3, ``ATB_CPU_ISA=generic`` forces the
baseline. Threading: the row kernels (norms, RoPE, activations, softmax) run
on the caller's thread (decode rows are one row); the few-row matmul
(``linear.c``) splits its weight rows over a small pthread pool of its own
(``pool.c``; not OpenMP: a second OpenMP runtime next to torch's would keep
its own spinning workers and fight torch's for the cores).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BuildResult", "build_library", "SOURCES", "cache_dir", "isa_flags", "cpu_flags", "UnsafeCache",
           "check_private", "private_dir"]

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("norm.c", "rope.c", "act.c", "softmax.c", "linear.c", "panel.c", "panel_avx2.c", "attn.c",
           "attn_passes.c", "flash.c",
           "cache.c", "argmax.c", "mt19937.c", "sample.c", "pool.c", "linear_w4.c", "linear_w4_tile.c", "flash_lanes.c",
           "flash_blocks.c", "panel_q8.c",
           "gemm_bf16.c", "gemm_i8.c", "flash_bf16.c", "program.c")
HEADERS = ("common.h", "pool.h", "simd.h", "norm.h", "linear.h", "mt19937.h", "gemm.h",
           "flash_bf16.h", "linear_w4.h", "flash_lanes.h", "attn.h")
# -ffp-contract=fast: -std=c11 turns FMA contraction off, which costs the
# polynomial loops (exp, erfc) ~30 % here; contraction only makes them more exact.
BASE_FLAGS = ("-O3", "-std=c11", "-fPIC", "-shared", "-fvisibility=hidden", "-fno-math-errno",
              "-fno-trapping-math", "-ffp-contract=fast", "-fopenmp-simd", "-Wall")
LIB_NAME = "libatb_cpu_kernels.so" if sys.platform != "darwin" else "libatb_cpu_kernels.dylib"
FAILED_NAME = "build-error.txt"  # a failed build's compiler output and time
RETRY_S = 3600.0  # default seconds before a failed ISA build is tried again


class UnsafeCache(OSError):
    """A cache directory or library another user could have written (refused)."""


def check_private(path: Path, kind: str = "dir") -> None:
    """Raise :class:`UnsafeCache` unless ``path`` is a real ``kind`` ("dir" or "file",
    not a symlink) owned by this user and not writable by group or others."""
    st = os.lstat(path)
    want = stat.S_ISDIR if kind == "dir" else stat.S_ISREG
    if not want(st.st_mode):
        raise UnsafeCache(f"{path} is not a {'directory' if kind == 'dir' else 'regular file'}"
                          " (a symlink or other kind): refused")
    uid = os.getuid() if hasattr(os, "getuid") else st.st_uid
    if st.st_uid != uid:
        raise UnsafeCache(f"{path} is owned by uid {st.st_uid}, not this user ({uid}): refused")
    if st.st_mode & 0o022:
        raise UnsafeCache(f"{path} is group/world-writable (mode {stat.S_IMODE(st.st_mode):o}):"
                          " refused")


def private_dir(path: Path) -> Path:
    """``path`` created 0700 when missing (parents too) and checked private."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=False)
    except FileExistsError:
        pass
    check_private(path)
    return path


@dataclass(frozen=True)
class BuildResult:
    """The library path, or why there is none; ``isa`` is what it was built for."""

    path: Path | None
    isa: str
    reason: str = ""
    compiled: bool = False   # True when this call ran the compiler (a cache miss)
    seconds: float = 0.0


def cache_dir() -> Path:
    """Per-user cache root for built libraries."""
    env = os.environ.get("ATB_CPU_KERNELS_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "atb" / "cpu_kernels"


def cpu_flags() -> set[str]:
    """The CPU's feature flags as ``/proc/cpuinfo`` lists them (empty where it cannot
    be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa_flags() -> list[tuple[str, tuple[str, ...]]]:
    """Builds to try, best first: ``[(isa name, compiler flags), ...]``."""
    want = os.environ.get("ATB_CPU_ISA", "").strip().lower()
    generic = ("generic", ())
    if want == "generic" or platform.machine().lower() not in ("x86_64", "amd64"):
        return [generic]
    flags = cpu_flags()
    out = []
    v3 = {"avx2", "fma", "f16c", "bmi2", "movbe"} <= flags
    v4 = v3 and {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"} <= flags
    if v4 and want != "avx2":
        out.append(("x86-64-v4", ("-march=x86-64-v4", "-mprefer-vector-width=512")))
    if v3:
        out.append(("x86-64-v3", ("-march=x86-64-v3",)))
    return out + [generic]


def _compiler() -> tuple[str | None, str]:
    cc = os.environ.get("CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        for alt in ("gcc", "clang"):
            path = shutil.which(alt)
            if path:
                break
    if path is None:
        return None, (f"no C compiler found ({cc!r}, gcc, clang not on PATH); install one "
                      "or set CC to enable the one-kernel CPU ops")
    return path, ""


def _key(cc: str, flags: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    st = os.stat(cc)
    h.update(f"{os.path.realpath(cc)}|{st.st_size}|{st.st_mtime_ns}|{platform.machine()}".encode())
    h.update(" ".join(BASE_FLAGS + flags).encode())
    return h.hexdigest()[:20]


COMPILE_TIMEOUT_S = 600.0  # per source file; a loaded machine can take minutes


class _Timeout(TimeoutError):
    """The compiler ran past :data:`COMPILE_TIMEOUT_S` (load, not a broken build)."""


def _run(cmd: list[str]) -> str:
    """Run one compiler command; its error text, or '' on success."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise _Timeout(f"the compiler ran past {COMPILE_TIMEOUT_S:.0f} s: {' '.join(cmd[-4:])}") from e
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    if r.returncode != 0:
        return (r.stderr or r.stdout).strip()[-2000:] or f"exit status {r.returncode}"
    return ""


def _compile(cc: str, flags: tuple[str, ...], dest: Path) -> str:
    """Compile into ``dest`` (atomically); returns an error text, or '' on success.
    Each source compiles to an object in its own process, as many at once as there are
    cores, then one link (the serial build of all sources took ~30 s on 2 loaded cores).
    Raises :class:`_Timeout` when a compile runs too long (not recorded as a failure)."""
    from concurrent.futures import ThreadPoolExecutor

    private_dir(dest.parent)
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=dest.parent))
    tmp = work / LIB_NAME
    objs = [work / (Path(s).stem + ".o") for s in SOURCES]
    compile_flags = [f for f in BASE_FLAGS if f != "-shared"]
    cmds = [[cc, *compile_flags, *flags, "-c", str(CSRC / s), "-o", str(o)]
            for s, o in zip(SOURCES, objs)]
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(len(cmds), os.cpu_count() or 1))) as ex:
            errs = [e for e in ex.map(_run, cmds) if e]
        if errs:
            return errs[0]
        err = _run([cc, "-shared", *flags, *map(str, objs), "-o", str(tmp), "-lm", "-lpthread",
                    "-ldl"])
        if err:
            return err
        os.chmod(tmp, 0o700)  # the compiler creates it by the umask: make it ours alone
        os.replace(tmp, dest)  # atomic: a loader sees the old file or the whole new one
        return ""
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _retry_s() -> float:
    try:
        return float(os.environ.get("ATB_CPU_KERNELS_RETRY_S", RETRY_S))
    except ValueError:
        return RETRY_S


def _recent_failure(failed: Path) -> str | None:
    """The recorded error of a failed build younger than the retry interval, else None."""
    try:
        age = time.time() - failed.stat().st_mtime
        if age >= _retry_s():
            return None
        return failed.read_text(errors="replace")
    except OSError:
        return None


def _cached(dest: Path) -> Path | None:
    """``dest`` when it exists and is safe to load; an unsafe one is removed (logged)
    so that the rebuild replaces it, or refused when it cannot be."""
    from ...log import logger

    if not os.path.lexists(dest):
        return None
    try:
        check_private(dest, "file")
        return dest
    except UnsafeCache as e:
        logger.warning("CPU kernels: cached library %s; rebuilding it", e)
        try:
            os.unlink(dest)
        except OSError:
            pass
        return None


def _fallback_root() -> Path:
    """A private directory for this process's build when the cache is refused:
    ``$TMPDIR/atb-cpu-kernels-<uid>`` when that is safe, else a fresh ``mkdtemp``."""
    from ...log import logger

    user = os.getuid() if hasattr(os, "getuid") else "user"
    shared = Path(tempfile.gettempdir()) / f"atb-cpu-kernels-{user}"
    try:
        return private_dir(shared)
    except OSError as e:
        logger.warning("CPU kernels: %s; building in a fresh private directory", e)
        return Path(tempfile.mkdtemp(prefix="atb-cpu-kernels-"))


def build_library() -> BuildResult:
    """The cached library for this machine, compiling it on a miss."""
    from ...log import logger

    cc, why = _compiler()
    if cc is None:
        return BuildResult(None, "", why)
    root = cache_dir()
    try:
        private_dir(root)
    except OSError as e:  # unsafe or not writable: never load from it
        logger.warning("CPU kernels: cache %s; using a private temporary directory", e)
        root = _fallback_root()
    errors = []
    for isa, flags in isa_flags():
        key = _key(cc, flags)
        dest = root / key / LIB_NAME
        try:
            if (root / key).exists():
                check_private(root / key)
            found = _cached(dest)
        except OSError as e:
            logger.warning("CPU kernels: %s; using a private temporary directory", e)
            root = _fallback_root()
            dest, found = root / key / LIB_NAME, None
        if found is not None:
            return BuildResult(found, isa)
        failed = dest.with_name(FAILED_NAME)
        recent = _recent_failure(failed)
        if recent is not None:  # failed lately: not retried by every process
            errors.append(f"{isa}: {recent.strip()[-300:]}")
            continue
        t0 = time.perf_counter()
        try:
            err = _compile(cc, flags, dest)
        except _Timeout as e:  # load, not a broken build: tried again by the next process
            errors.append(f"{isa}: {e}")
            continue
        except OSError as e:  # cache dir not writable or refused: a private temp dir
            alt = _fallback_root() / key / LIB_NAME
            err = f"{e}"
            if _cached(alt) is not None:
                return BuildResult(alt, isa)
            try:
                err = _compile(cc, flags, alt)
            except OSError as e2:
                err = str(e2)
            if not err:
                dest = alt
        if not err:
            if os.path.lexists(failed):
                os.unlink(failed)  # an earlier failure was transient
            return BuildResult(dest, isa, compiled=True, seconds=time.perf_counter() - t0)
        errors.append(f"{isa}: {err.splitlines()[-1] if err else 'failed'}")
        try:
            failed.write_text(err or "failed")
        except OSError:
            pass
    return BuildResult(None, "", "the C kernels did not compile (" + "; ".join(errors) + ")")
