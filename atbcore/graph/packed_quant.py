"""The inverses of the quantized Linears' packed layouts (framework-free NumPy), so a
graph holding only the packed forms still gives its logical weights back (saving a
graph, ``to_numpy``, a kernel that reads the weight as stored).

* ``w8a8 VNNI panels`` (:func:`atbcore.backends.cpu_kernels.torch_w8a8.pack_w8a8`):
  int8 ``[P, K4 + 1, 32, 4]``, ``p[i, q, j, t] = w[32 i + j, 4 q + t]``, the last row
  the panels' int32 column sums.
* ``w4 32-output panels`` (:func:`atbcore.backends.cpu_kernels.torch_linear_w4.pack_w4`),
  three parts: ``weight`` the 4-bit codes ``[P, K'/32, 512]`` (per block of 32 inputs,
  ``[kk 8, j 16, t 4]`` bytes, low nibble output ``j``, high nibble ``16 + j``),
  ``scale`` and ``zeros`` ``[P, G, 32]`` (a panel's 32 outputs side by side per group).

The packers are the kernels' own; the layouts are theirs, read back here.
"""

from __future__ import annotations

import numpy as np

from ..errors import ShapeError

__all__ = ["unpack_quant"]

_PANEL = 32


def _w4_codes(p: np.ndarray, n: int, k: int) -> np.ndarray:
    panels, nblk, _ = p.shape
    v = p.reshape(panels, nblk, 8, 16, 4).transpose(0, 3, 1, 2, 4)  # [P, j, blk, kk, t]
    q = np.stack([v & 15, v >> 4], axis=1)                          # [P, half, j, ...]
    return np.ascontiguousarray(q.reshape(panels * _PANEL, nblk * _PANEL)[:n, :k])


def _panel_columns(p: np.ndarray, n: int) -> np.ndarray:
    """``[P, G, 32]`` -> ``[N, G]``."""
    return np.ascontiguousarray(p.transpose(0, 2, 1).reshape(-1, p.shape[1])[:n])


def _w8a8(p: np.ndarray, n: int, k: int) -> np.ndarray:
    panels, k4 = p.shape[0], p.shape[1] - 1
    m = p[:, :k4].transpose(0, 2, 1, 3).reshape(panels * _PANEL, k4 * 4)
    return np.ascontiguousarray(m[:n, :k])


def unpack_quant(p: np.ndarray, layout: object, shape: tuple[int, ...]) -> np.ndarray:
    """The logical ``[N, K]`` (codes, or ``[N, G]`` scales / zero points) of raw packed
    elements ``p`` in ``layout`` (a :class:`~atbcore.graph.packed.Layout`), as raw
    elements of the same width."""
    from .packed import W4, W8A8

    name, part = getattr(layout, "name", None), getattr(layout, "part", "")
    n, k = int(shape[0]), int(shape[1])
    if name == W8A8:
        return _w8a8(p, n, k)
    if name == W4 and part == "weight":
        return _w4_codes(p, n, k)
    if name == W4 and part in ("scale", "zeros"):
        return _panel_columns(p, n)
    raise ShapeError("unpack", "layout", f"32-output panels, {W8A8} or {W4}",
                     f"{name} ({part})" if part else name)
