"""The weight layouts this backend's kernels read, for the layout pass
(:data:`atbcore.passes.layout.CHOOSERS`): the framework-free C kernels' panels
(:mod:`atbcore.backends.cpu_kernels.native_layout`) for the ops this backend runs
on them."""

from atbcore.backends.cpu_kernels.native_layout import native_chooser

__all__ = ["preferred_layout"]

preferred_layout = native_chooser("mindspore")
