"""atb's plugin system (pluggy).

* The contract is :mod:`atbcore.plugin.hookspecs`; implement hooks with
  ``@hookimpl`` and expose the module through the entry-point group ``atb``.
* :func:`get_plugin_manager` loads every plugin once per process
  (``ATB_PLUGINS`` allowlist, ``ATB_DISABLE_PLUGINS`` blocklist,
  ``ATB_PLUGINS_STRICT=1`` makes load failures fatal, ``ATB_TRACE_PLUGINS=1``
  logs every hook call through the built-in tracing plugin).
* :class:`Plugin` / :func:`apply_point` are the GraphOp-level plugins at the
  named :data:`POINTS`, with typed payloads (:mod:`.payloads`); the ``rope``
  point (:func:`apply_rope`, :func:`builtin_rope`) replaces the rotation;
  :func:`call_graph_hook` runs the graph-rewrite hooks.

Importing this package imports no deep-learning framework.
"""

from __future__ import annotations

from .graph_hooks import GRAPH_HOOKS, call_graph_hook
from .isolation import PluginDtypeError, PluginShapeError, check_tensors
from .manager import AtbPluginManager, PluginRecord, get_plugin_manager, reset_plugin_manager
from .markers import ENTRY_POINT_GROUP, hookimpl, hookspec
from .payloads import AttentionPayload, CacheState, PointPayload, RopeParameters, RopePayload
from .points import POINTS, Plugin, apply_point
from .resolve import model_architecture, plugin_fusion_rules, resolve_activation, rope_frequencies
from .rope_config import RopeSettings, rope_settings
from .rope_point import apply_rope, builtin_rope
from .types import ActivationSpec, RopeFrequencies

__all__ = [
    "POINTS",
    "Plugin",
    "AttentionPayload",
    "CacheState",
    "PointPayload",
    "RopeParameters",
    "RopePayload",
    "apply_rope",
    "builtin_rope",
    "apply_point",
    "call_graph_hook",
    "GRAPH_HOOKS",
    "get_plugin_manager",
    "reset_plugin_manager",
    "AtbPluginManager",
    "PluginRecord",
    "hookimpl",
    "hookspec",
    "ENTRY_POINT_GROUP",
    "ActivationSpec",
    "RopeFrequencies",
    "RopeSettings",
    "rope_settings",
    "resolve_activation",
    "rope_frequencies",
    "model_architecture",
    "plugin_fusion_rules",
    "check_tensors",
    "PluginShapeError",
    "PluginDtypeError",
]
