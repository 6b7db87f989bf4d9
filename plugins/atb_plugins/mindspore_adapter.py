"""The atb_mindspore adapter as an ``atb`` plugin, found through the entry-point group:

    [project.entry-points.atb]
    atb_mindspore = "atb_plugins.mindspore_adapter"

Importing the ``atb_mindspore`` package imports MindSpore (it must precede Paddle
in a process), so this plugin lives outside it and acts only when MindSpore is
already loaded: a process that never touches MindSpore never pays for it, and
``import atb_mindspore`` registers the same backend and bridge itself.
"""

from __future__ import annotations

import sys

from atbcore.plugin.markers import hookimpl

__all__ = ["atb_register_backends", "atb_register_adapters"]


@hookimpl
def atb_register_backends() -> None:
    """Add the ``mindspore`` backend when MindSpore is in use."""
    if "mindspore" in sys.modules:
        from atb_mindspore.plugin import atb_register_backends as register

        register()


@hookimpl
def atb_register_adapters() -> None:
    """Install the MindSpore tensor bridge when MindSpore is in use."""
    if "mindspore" in sys.modules:
        from atb_mindspore.plugin import atb_register_adapters as register

        register()
