"""Finding and loading plugins from the entry-point group ``atb``.

Environment:

* ``ATB_PLUGINS=a,b`` — allowlist: load only these entry points (matched by
  entry-point name or distribution name). Unset or empty: load all.
* ``ATB_DISABLE_PLUGINS=c,d`` — blocklist: never load these (wins over the
  allowlist; also blocks registering them by hand under that name).
* ``ATB_PLUGINS_STRICT=1`` — a plugin that fails to import or set up is fatal
  (PluginError) instead of being reported by name and skipped.

Discovery uses :mod:`importlib.metadata` over the installed distributions, the
same metadata pluggy's ``load_setuptools_entrypoints`` reads, so a plugin is
found exactly when pip would have installed it.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
from typing import Any, Iterator

from ..errors import PluginError
from ..log import logger
from .isolation import plugin_error
from .manager import AtbPluginManager, PluginRecord
from .markers import ENTRY_POINT_GROUP

__all__ = ["load_entry_point_plugins", "entry_points", "env_names", "env_flag"]


def env_names(var: str) -> set[str] | None:
    """Names in a comma/space separated environment variable (normalized), or
    ``None`` when it is unset or empty."""
    raw = os.environ.get(var, "").strip()
    if not raw:
        return None
    return {_norm(n) for n in re.split(r"[,\s]+", raw) if n}


def env_flag(var: str) -> bool:
    """True when ``var`` is set to 1/true/yes/on."""
    return os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on")


def _norm(name: str) -> str:
    # distribution names compare case-insensitively with - _ . equivalent (PEP 503)
    return re.sub(r"[-_.]+", "-", name).lower()


def entry_points(group: str = ENTRY_POINT_GROUP) -> Iterator[tuple[Any, Any]]:
    """(distribution, entry point) for every entry point in ``group``, in
    distribution order (as on ``sys.path``), first occurrence of a name only."""
    seen: set[str] = set()
    for dist in md.distributions():
        for ep in dist.entry_points:
            if ep.group == group and ep.name not in seen:
                seen.add(ep.name)
                yield dist, ep


def _matches(names: set[str], ep: Any, dist_name: str) -> bool:
    return _norm(ep.name) in names or _norm(dist_name) in names


def load_entry_point_plugins(pm: AtbPluginManager, group: str = ENTRY_POINT_GROUP) -> list[str]:
    """Load every allowed, not yet known plugin of ``group`` into ``pm``.

    Returns the names loaded by this call. Names already registered or already
    recorded (failed, disabled) are skipped, so calling it again loads nothing
    new. A plugin that fails to import or set up — any exception but
    KeyboardInterrupt, ``SystemExit`` from a ``sys.exit()`` included — is logged with
    its name and recorded as ``failed`` (the process goes on), or, with
    ``ATB_PLUGINS_STRICT=1``, raises PluginError."""
    allow = env_names("ATB_PLUGINS")
    deny = env_names("ATB_DISABLE_PLUGINS") or set()
    strict = env_flag("ATB_PLUGINS_STRICT")
    loaded: list[str] = []
    for dist, ep in entry_points(group):
        name = ep.name
        if pm.has_plugin(name) or name in pm.records:
            continue
        dist_name = dist.metadata["Name"] or "?"
        version = dist.version
        rec = PluginRecord(name, "loaded", f"entry point {dist_name} {version} ({ep.value})",
                           distribution=dist_name, version=version, value=ep.value)
        if _matches(deny, ep, dist_name):
            pm.set_blocked(name)
            rec.status = "disabled"
            pm.records[name] = rec
            continue
        if allow is not None and not _matches(allow, ep, dist_name):
            rec.status = "not allowed"
            pm.records[name] = rec
            continue
        try:
            plugin = ep.load()
            if isinstance(plugin, type):  # a class names its own instance
                plugin = plugin()
            pm.register(plugin, name=name, record=rec)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - sys.exit() at import is a broken plugin
            # too, not a reason for the user's process to end without a word
            rec.status, rec.error = "failed", f"{type(e).__name__}: {e}"
            if isinstance(e, PluginError) and getattr(e, "plugin", None):
                failure = e
            else:
                failure = plugin_error(name, f"failed to load from {dist_name} {version} "
                                       f"({ep.value}): {type(e).__name__}: {e}")
                failure.__cause__ = e
            pm.records[name] = rec
            pm.failures[name] = failure
            if strict:
                if failure is e:
                    raise
                raise failure from e
            logger.warning("plugin '%s' (%s %s) failed to load and is skipped: %s: %s",
                           name, dist_name, version, type(e).__name__, e)
            continue
        loaded.append(name)
    if allow:
        known = {_norm(n) for n in pm.records} | {
            _norm(r.distribution) for r in pm.records.values() if r.distribution}
        for missing in sorted(allow - known):
            logger.warning("ATB_PLUGINS names '%s', but no plugin of that name is installed",
                           missing)
    return loaded
