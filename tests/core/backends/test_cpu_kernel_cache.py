"""The compiled-kernel cache is trusted only when nobody else could have written it:
a planted world-writable or foreign-owned library is never loaded (its constructor
never runs), a world-writable cache directory or ``$TMPDIR/atb-cpu-kernels-<uid>`` is
refused, and a failed ISA build is retried after ``ATB_CPU_KERNELS_RETRY_S``."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from atbcore.backends.cpu_kernels import bindings, build

CC = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler here")
FOREIGN_UID = 12345  # any uid but ours (the tests run as root, so chown works)


def _plant(path: Path, marker: Path) -> None:
    """A shared library whose constructor creates ``marker`` when it is loaded."""
    path.parent.mkdir(parents=True, exist_ok=True)
    src = path.with_suffix(".c")
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void pwn(void) '
                   f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([CC, "-shared", "-fPIC", str(src), "-o", str(path)], check=True)
    src.unlink()


def _fake_compiler(monkeypatch, fail: set[str]) -> list[str]:
    """Replace the compiler: flags in ``fail`` fail, others write a private file."""
    calls: list[str] = []

    def fake(cc, flags, dest):
        calls.append(" ".join(flags) or "generic")
        build.private_dir(dest.parent)
        if set(flags) & fail:
            return "error: unknown flag (transient)"
        dest.write_bytes(b"\x7fELF fake")
        os.chmod(dest, 0o700)
        return ""

    monkeypatch.setattr(build, "_compile", fake)
    return calls


@needs_cc
def test_a_planted_world_writable_library_is_replaced_and_never_loaded(monkeypatch, tmp_path,
                                                                        caplog):
    monkeypatch.setenv("ATB_CPU_ISA", "generic")
    monkeypatch.setenv("ATB_CPU_KERNELS_CACHE", str(tmp_path / "cache"))
    cc, _ = build._compiler()
    dest = tmp_path / "cache" / build._key(cc, ()) / build.LIB_NAME
    marker = tmp_path / "constructor-ran"
    _plant(dest, marker)
    os.chmod(dest.parent, 0o700)
    os.chmod(dest, 0o777)
    with pytest.raises(build.UnsafeCache, match="world-writable"):
        build.check_private(dest, "file")
    with caplog.at_level(logging.WARNING, logger="atb"):
        res = build.build_library()
    assert "refused" in caplog.text and str(dest) in caplog.text
    assert res.compiled and res.path == dest                  # rebuilt in place, atomically
    st = os.stat(dest)
    assert st.st_uid == os.getuid() and not st.st_mode & 0o022
    lib = ctypes.CDLL(str(res.path))
    assert all(hasattr(lib, n) for n in bindings.ENTRY_POINTS)
    assert not marker.exists()                                # the planted code never ran


@needs_cc
def test_a_foreign_owned_library_is_refused_by_the_loader(monkeypatch, tmp_path):
    lib_dir = tmp_path / "k"
    lib_dir.mkdir(mode=0o700)
    path, marker = lib_dir / build.LIB_NAME, tmp_path / "constructor-ran"
    _plant(path, marker)
    os.chmod(path, 0o755)
    os.chown(path, FOREIGN_UID, -1)
    assert build._cached(path) is None and not path.exists()   # the build step drops it
    _plant(path, marker)
    os.chown(path, FOREIGN_UID, -1)
    monkeypatch.setattr(bindings, "build_library", lambda: build.BuildResult(path, "generic"))
    monkeypatch.setattr(bindings, "_STATE", {})
    assert bindings.library() is None                          # the loader checks again
    assert f"owned by uid {FOREIGN_UID}" in bindings.unavailable_reason()
    assert not marker.exists()


def test_world_writable_cache_and_tmp_dirs_are_refused(monkeypatch, tmp_path, caplog):
    shared = tmp_path / "shared-cache"
    shared.mkdir()
    os.chmod(shared, 0o777)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    planted = tmp / f"atb-cpu-kernels-{os.getuid()}"
    planted.mkdir()
    os.chmod(planted, 0o777)
    monkeypatch.setenv("ATB_CPU_KERNELS_CACHE", str(shared))
    monkeypatch.setattr(build.tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(build, "isa_flags", lambda: [("generic", ())])
    calls = _fake_compiler(monkeypatch, set())
    with caplog.at_level(logging.WARNING, logger="atb"):
        res = build.build_library()
    assert calls == ["generic"] and res.path is not None
    assert not res.path.is_relative_to(shared) and not res.path.is_relative_to(planted)
    assert res.path.is_relative_to(tmp)                        # a fresh mkdtemp under $TMPDIR
    build.check_private(res.path.parent.parent)
    assert str(shared) in caplog.text and str(planted) in caplog.text
    assert "group/world-writable" in caplog.text
    assert not any(shared.iterdir()) and not any(planted.iterdir())
    shutil.rmtree(res.path.parent.parent)


def test_a_foreign_owned_cache_key_dir_is_not_used(monkeypatch, tmp_path):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("ATB_CPU_KERNELS_CACHE", str(root))
    monkeypatch.setattr(build.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(build, "isa_flags", lambda: [("generic", ())])
    calls = _fake_compiler(monkeypatch, set())
    cc, _ = build._compiler()
    key_dir = root / build._key(cc, ())
    key_dir.mkdir(mode=0o700)
    os.chown(key_dir, FOREIGN_UID, -1)
    res = build.build_library()
    assert calls == ["generic"] and not res.path.is_relative_to(root)


def test_a_failed_isa_build_is_retried_after_the_interval(monkeypatch, tmp_path):
    monkeypatch.setenv("ATB_CPU_KERNELS_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "isa_flags", lambda: [("fast", ("-mfast",)), ("generic", ())])
    calls = _fake_compiler(monkeypatch, {"-mfast"})
    first = build.build_library()
    assert first.isa == "generic" and calls == ["-mfast", "generic"]
    marker, = tmp_path.glob(f"*/{build.FAILED_NAME}")
    again = build.build_library()                              # within the interval: skipped
    assert again.isa == "generic" and not again.compiled and calls == ["-mfast", "generic"]
    calls2 = _fake_compiler(monkeypatch, set())                # the compiler works again
    old = time.time() - build.RETRY_S - 1
    os.utime(marker, (old, old))
    third = build.build_library()
    assert third.isa == "fast" and third.compiled and calls2 == ["-mfast"]
    assert not marker.exists()
    monkeypatch.setenv("ATB_CPU_KERNELS_RETRY_S", "0")         # or retried at once when told
    calls3 = _fake_compiler(monkeypatch, {"-mfast"})
    for p in tmp_path.glob(f"*/{build.LIB_NAME}"):
        p.unlink()
    build.build_library()
    build.build_library()
    assert calls3 == ["-mfast", "generic", "-mfast"]


def test_a_compile_timeout_is_not_recorded_as_a_failure(monkeypatch, tmp_path):
    """A loaded machine's slow compile falls to the next ISA for this process only: no
    build-error.txt, so the next process tries the best ISA again."""
    monkeypatch.setenv("ATB_CPU_KERNELS_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "isa_flags", lambda: [("fast", ("-mfast",)), ("generic", ())])
    monkeypatch.setattr(build, "COMPILE_TIMEOUT_S", 0.01)
    calls: list[str] = []

    def slow_or_broken(cmd, **kw):
        calls.append(cmd[0])
        if "-mfast" in cmd:
            raise subprocess.TimeoutExpired(cmd, kw["timeout"])
        return subprocess.CompletedProcess(cmd, 1, "", "error: no compiler (stub)")

    monkeypatch.setattr(build.subprocess, "run", slow_or_broken)
    res = build.build_library()
    assert res.path is None and "ran past" in res.reason and "no compiler" in res.reason
    fast_dir = tmp_path / build._key(build._compiler()[0], ("-mfast",))
    assert not (fast_dir / build.FAILED_NAME).exists()           # not recorded: retried
    assert (tmp_path / build._key(build._compiler()[0], ()) / build.FAILED_NAME).exists()
    assert not any(p.name.startswith(".build-") for p in fast_dir.iterdir())  # cleaned


@needs_cc
def test_the_parallel_build_links_every_entry_point(monkeypatch, tmp_path):
    monkeypatch.setenv("ATB_CPU_KERNELS_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "isa_flags", lambda: [("generic", ())])
    res = build.build_library()
    assert res.compiled and res.path is not None and res.isa == "generic"
    lib = ctypes.CDLL(str(res.path))
    assert all(hasattr(lib, n) for n in bindings.ENTRY_POINTS)
    assert sorted(p.name for p in res.path.parent.iterdir()) == [build.LIB_NAME]
