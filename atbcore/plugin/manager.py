"""The plugin manager: one per process, loaded from the ``atb`` entry points once.

``get_plugin_manager()`` creates it on first use, loads every plugin found in
the entry-point group ``atb`` (built-in and third-party alike; see
:mod:`atbcore.plugin.loader` for ``ATB_PLUGINS`` / ``ATB_DISABLE_PLUGINS`` /
``ATB_PLUGINS_STRICT``) and returns the same manager afterwards.
``reset_plugin_manager()`` drops it (tests).

Registering a plugin (from an entry point or by hand) runs its set-up hooks
(``atb_configure``, ``atb_register_ops``, ``atb_register_backends``,
``atb_register_adapters``, ``atb_register_fusion_rules``) for that plugin
alone, so a plugin registered late behaves like one loaded at start-up.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import pluggy

from ..errors import PluginError
from ..log import logger
from . import hookspecs
from .isolation import guarded_hookexec, plugin_error
from .markers import PROJECT

__all__ = ["AtbPluginManager", "PluginRecord", "get_plugin_manager", "reset_plugin_manager",
           "SETUP_HOOKS", "EXECUTION_HOOKS"]

#: hooks run once per plugin when it is registered, in this order
SETUP_HOOKS = ("atb_configure", "atb_register_ops", "atb_register_backends",
               "atb_register_adapters", "atb_register_fusion_rules")
#: hooks a GraphOp calls while it runs; with none implemented it runs its bound program
EXECUTION_HOOKS = ("atb_preprocess", "atb_postprocess", "atb_rope")


@dataclass
class PluginRecord:
    """What the manager knows about one plugin name (loaded or not).

    ``status``: ``loaded``, ``failed`` (import or set-up error, see ``error``),
    ``disabled`` (``ATB_DISABLE_PLUGINS``), ``not allowed`` (not in
    ``ATB_PLUGINS``). ``source``: where it came from, e.g.
    ``entry point atb-example-plugin 0.1.0 (atb_example_plugin)`` or ``runtime``."""

    name: str
    status: str
    source: str
    distribution: str | None = None
    version: str | None = None
    value: str | None = None
    error: str | None = None
    hooks: list[str] = field(default_factory=list)


class AtbPluginManager(pluggy.PluginManager):
    """pluggy's PluginManager with atb's specs, isolation and bookkeeping.

    Every hook call goes through a guard that re-raises a plugin's exception as
    PluginError naming the plugin and hook. ``records`` keeps one
    :class:`PluginRecord` per plugin name; ``fusion_rules`` collects what
    ``atb_register_fusion_rules`` returned, as (plugin name, rule) pairs."""

    def __init__(self) -> None:
        super().__init__(PROJECT)
        self.add_hookspecs(hookspecs)
        self._inner_hookexec = guarded_hookexec(self._inner_hookexec)
        self.records: dict[str, PluginRecord] = {}
        # name -> the PluginError a failed load became (records stay plain data)
        self.failures: dict[str, PluginError] = {}
        self.fusion_rules: list[tuple[str, Any]] = []
        self._undo: list[Any] = []  # undo callables (e.g. hook-call monitoring)
        self.trace_records: Any = None  # set by the tracing plugin when tracing is on
        self._executing: bool | None = None  # execution_hooks_active(), until (un)register

    # ------------------------------------------------------------------ registration
    def register(self, plugin: Any, name: str | None = None, *, source: str = "runtime",
                 record: PluginRecord | None = None) -> str | None:
        """Register ``plugin`` and run its set-up hooks. Returns its name, or
        ``None`` when the name is blocked. A failing set-up hook unregisters the
        plugin again and raises PluginError naming it."""
        try:
            registered = super().register(plugin, name)
        except pluggy.PluginValidationError as e:
            # pluggy may have added some of the plugin's hooks before failing
            if self.is_registered(plugin):
                super().unregister(plugin)
            raise plugin_error(name or self.get_canonical_name(plugin),
                               f"invalid hook implementation: {e}") from e
        self._executing = None
        if registered is None:
            return None
        rec = record or PluginRecord(registered, "loaded", source)
        rec.status = "loaded"
        self.records[registered] = rec
        try:
            self._setup(plugin, registered)
        except BaseException as e:  # noqa: BLE001 - undone for every kind, then re-raised
            self.unregister(plugin)
            rec.status, rec.error = "failed", str(e)
            self.records[registered] = rec
            raise
        return registered

    def _setup(self, plugin: Any, name: str) -> None:
        for hook in SETUP_HOOKS:
            kwargs = {"manager": self} if hook == "atb_configure" else {}
            results = self.call_plugin(hook, plugin, **kwargs)
            if hook == "atb_register_fusion_rules":
                for rules in results:
                    self.fusion_rules.extend((name, r) for r in rules or ())

    # ------------------------------------------------------------------ per-plugin calls
    def plugins_in_call_order(self, hook: str) -> list[tuple[str, Any]]:
        """(name, plugin) of every plugin implementing ``hook``, in the order
        pluggy calls them (tryfirst, then newest first, then trylast)."""
        out: list[tuple[str, Any]] = []
        seen: set[int] = set()
        for impl in reversed(getattr(self.hook, hook).get_hookimpls()):
            if id(impl.plugin) not in seen:
                seen.add(id(impl.plugin))
                out.append((impl.plugin_name, impl.plugin))
        return out

    def call_plugin(self, hook: str, plugin: Any, **kwargs: Any) -> list:
        """Call ``hook`` on one plugin only (through the guard and any hook-call
        monitoring); returns its non-None results. Used where each plugin's
        answer is validated or chained before the next plugin runs."""
        impls = [i for i in getattr(self.hook, hook).get_hookimpls() if i.plugin is plugin]
        if not impls:
            return []
        # pluggy's own dispatch (what HookCaller.__call__ uses), restricted to one plugin;
        # subset_hook_caller cannot do this for impls registered under a ``specname``.
        return self._hookexec(hook, impls, kwargs, False)

    def unregister(self, plugin: Any = None, name: str | None = None) -> Any:
        """Unregister a plugin (by object or name) and drop its fusion rules."""
        if name is None and plugin is not None:
            name = self.get_name(plugin)
        out = super().unregister(plugin, name)
        self._executing = None
        if name is not None:
            self.fusion_rules = [(n, r) for n, r in self.fusion_rules if n != name]
            self.records.pop(name, None)
        cache = getattr(self._inner_hookexec, "cache", None)
        if cache is not None:
            cache.clear()
        return out

    # ------------------------------------------------------------------ queries
    def execution_hooks_active(self) -> bool:
        """True when some plugin implements an execution hook (``atb_preprocess``,
        ``atb_postprocess``, ``atb_rope``); remembered until the next (un)register,
        so a GraphOp asks it per call for the price of an attribute read."""
        active = self._executing
        if active is None:
            active = self._executing = any(getattr(self.hook, h).get_hookimpls()
                                           for h in EXECUTION_HOOKS)
        return active

    def hooks_of(self, plugin: Any) -> list[str]:
        """Names of the atb hooks ``plugin`` implements (sorted)."""
        return sorted({c.name for c in (self.get_hookcallers(plugin) or [])})

    def describe(self) -> list[PluginRecord]:
        """One record per plugin name (loaded plugins carry their hooks)."""
        out = []
        for name, rec in self.records.items():
            plugin = self.get_plugin(name)
            if plugin is not None:
                rec.hooks = self.hooks_of(plugin)
            out.append(rec)
        return out

    def add_undo(self, undo: Any) -> None:
        """Remember a callable to run when the manager is reset (monitoring etc.)."""
        self._undo.append(undo)

    def close(self) -> None:
        """Undo monitoring installed by plugins (run by ``reset_plugin_manager``)."""
        while self._undo:
            self._undo.pop()()


_lock = threading.RLock()
_manager: AtbPluginManager | None = None


def get_plugin_manager() -> AtbPluginManager:
    """The process's plugin manager; the first call loads the ``atb`` entry points
    (idempotent: later calls return the same manager and load nothing)."""
    global _manager
    if _manager is not None:
        return _manager
    with _lock:
        if _manager is None:
            from .loader import load_entry_point_plugins

            pm = AtbPluginManager()
            load_entry_point_plugins(pm)  # may raise in strict mode: then nothing is kept
            _manager = pm
            loaded = [r.name for r in pm.records.values() if r.status == "loaded"]
            logger.debug("plugins loaded: %s", ", ".join(loaded) or "none")
    return _manager


def reset_plugin_manager() -> None:
    """Forget the process's plugin manager (for tests): the next
    ``get_plugin_manager()`` loads the entry points again."""
    global _manager
    with _lock:
        if _manager is not None:
            _manager.close()
        _manager = None
