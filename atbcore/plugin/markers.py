"""The pluggy markers of atb: ``hookspec`` declares a hook, ``hookimpl`` implements one.

Plugins import ``hookimpl`` from ``atbcore.plugin`` (or any front-end) and mark
their functions with it::

    from atbcore.plugin import hookimpl

    @hookimpl
    def atb_activation(name):
        ...
"""

from __future__ import annotations

import pluggy

__all__ = ["PROJECT", "ENTRY_POINT_GROUP", "hookspec", "hookimpl"]

#: pluggy project name; hook implementations carry this marker.
PROJECT = "atb"
#: entry-point group through which every plugin (built-in or third-party) is found.
ENTRY_POINT_GROUP = "atb"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
