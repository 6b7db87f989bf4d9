"""atb_mindspore as an ``atb`` plugin: registers the MindSpore backend and tensor
bridge when the plugin manager loads the entry point

    [project.entry-points.atb]
    atb_mindspore = "atb_mindspore.plugin"

Importing this module imports no MindSpore (the backend loads its kernels, and so
MindSpore, at its first dispatch).
"""

from __future__ import annotations

from atbcore.plugin.markers import hookimpl

__all__ = ["atb_register_backends", "atb_register_adapters"]


@hookimpl
def atb_register_backends() -> None:
    """Add the ``mindspore`` backend (priority 20, asked first for MindSpore tensors)."""
    from .backend import register

    register()


@hookimpl
def atb_register_adapters() -> None:
    """Teach the core every MindSpore tensor (Parameters too) and torch-free
    NumPy <-> MindSpore exchange."""
    from .bridge import install_bridge

    install_bridge()
