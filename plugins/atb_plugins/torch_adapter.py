"""The atb_torch adapter as an ``atb`` plugin, found through the entry-point group
like any other:

    [project.entry-points.atb]
    atb_torch = "atb_plugins.torch_adapter"

It lives outside the ``atb_torch`` package because importing that package imports
torch; loading this plugin imports no torch. When torch is already in use in the process, it
registers atb's ops with ``torch.library`` (``torch.ops.atb.*``), so a model that
reaches atb through the core (e.g. a plugin's graph rewrite) can be traced by
``torch.compile`` without importing ``atb_torch`` by hand.
"""

from __future__ import annotations

import sys

from atbcore.plugin.markers import hookimpl

__all__ = ["atb_register_adapters"]


@hookimpl
def atb_register_adapters() -> None:
    """Register ``torch.ops.atb.*`` if torch is loaded (never imports it)."""
    if "torch" in sys.modules:
        import atb_torch.library  # noqa: F401  (registration happens on import)
