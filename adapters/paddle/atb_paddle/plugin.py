"""atb_paddle as an ``atb`` plugin: registers the Paddle backend and the Paddle
tensor bridge when the plugin manager loads the entry point

    [project.entry-points.atb]
    atb_paddle = "atb_paddle.plugin"

Importing this module imports no Paddle (the backend loads its kernels, and so
Paddle, at its first dispatch), so MindSpore can still be imported first in the
same process.
"""

from __future__ import annotations

from atbcore.plugin.markers import hookimpl

__all__ = ["atb_register_backends", "atb_register_adapters"]


@hookimpl
def atb_register_backends() -> None:
    """Add the ``paddle`` backend (priority 30, asked first for Paddle tensors)."""
    from .backend import register

    register()


@hookimpl
def atb_register_adapters() -> None:
    """Teach the core Paddle tensors without torch (DLPack straight to NumPy)."""
    from .bridge import install_bridge

    install_bridge()
