"""Test support: installed-looking plugin distributions in a temporary site dir.

``FakeSite.add_dist`` writes what pip leaves in site-packages — the modules and
a ``<name>-<version>.dist-info`` with ``METADATA``, ``entry_points.txt``,
``top_level.txt`` and ``RECORD`` — into a directory put on ``sys.path``, so
``importlib.metadata`` (and therefore atb's loader and pluggy's
``load_setuptools_entrypoints``) discovers it exactly as an installed package.

The ``plugin_env`` fixture gives a clean plugin state: the ATB_* plugin
variables unset, the process manager reset before and after, the fake site
removed from ``sys.path`` and its modules from ``sys.modules`` afterwards.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest

from atbcore.plugin import reset_plugin_manager

ENV_VARS = ("ATB_PLUGINS", "ATB_DISABLE_PLUGINS", "ATB_PLUGINS_STRICT", "ATB_TRACE_PLUGINS")


class FakeSite:
    """A temporary site-packages directory on ``sys.path``."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.modules: set[str] = set()
        monkeypatch.syspath_prepend(str(root))

    def add_dist(self, name: str, version: str = "1.0", entry_points: dict[str, str] | None = None,
                 files: dict[str, str] | None = None, group: str = "atb") -> Path:
        """Install distribution ``name``: ``files`` (relative path -> source) and
        entry points ``{ep name: "module[:attr]"}`` in ``group``."""
        files = files or {}
        for rel, src in files.items():
            path = self.root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(src))
            self.modules.add(Path(rel).with_suffix("").parts[0])
        info = self.root / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        eps = "".join(f"{k} = {v}\n" for k, v in (entry_points or {}).items())
        (info / "entry_points.txt").write_text(f"[{group}]\n{eps}")
        tops = sorted({Path(rel).parts[0].removesuffix(".py") for rel in files})
        (info / "top_level.txt").write_text("".join(t + "\n" for t in tops))
        record = [f"{rel},," for rel in files] + [f"{info.name}/{f},," for f in
                                                  ("METADATA", "entry_points.txt", "top_level.txt",
                                                   "RECORD")]
        (info / "RECORD").write_text("\n".join(record) + "\n")
        importlib.invalidate_caches()
        return info

    def add_plugin(self, ep_name: str, source: str, dist: str | None = None,
                   module: str | None = None, version: str = "1.0") -> str:
        """One-module plugin distribution; returns the module name."""
        module = module or f"fake_{ep_name}"
        self.add_dist(dist or f"fake-{ep_name}".replace("_", "-"), version,
                      {ep_name: module}, {f"{module}.py": source})
        return module

    def cleanup(self) -> None:
        for name in list(sys.modules):
            if name.split(".")[0] in self.modules:
                del sys.modules[name]


@pytest.fixture
def plugin_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A clean plugin state and a :class:`FakeSite` to install plugins into."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    reset_plugin_manager()
    site = FakeSite(tmp_path / "site", monkeypatch)
    try:
        yield site
    finally:
        reset_plugin_manager()
        site.cleanup()
        importlib.invalidate_caches()
