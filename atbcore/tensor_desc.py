"""The descriptor of a tensor: shape, dtype, format and device, without its data.

Kept apart from :mod:`atbcore.tensor` (the exchange between frameworks), which
re-exports it: ``from atbcore.tensor import TensorDesc`` stays the public path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .dtypes import Dtype

__all__ = ["TensorDesc"]


@dataclass(frozen=True)
class TensorDesc:
    """Shape, dtype and layout of a tensor, without its data.

    ``TensorDesc(shape=[2, 512, 4096], dtype=Dtype.FP16)``. A dimension may be
    ``-1`` where it is only known at run time (e.g. the token count after Unpad).
    """

    shape: tuple[int, ...]
    dtype: Dtype = Dtype.FP32
    format: str = "ND"
    device: str = "cpu"

    def __init__(self, shape: Sequence[int], dtype: Any = Dtype.FP32, format: str = "ND",
                 device: str = "cpu") -> None:
        from .errors import DtypeError, ShapeError

        dims = tuple(int(s) for s in shape)
        if any(s < -1 for s in dims):  # -1 marks a dim known only at run time
            raise ShapeError("TensorDesc", "shape", "sizes >= 0 (or -1 for unknown)", list(dims))
        try:
            dt = Dtype.of(dtype)
        except (ValueError, TypeError):
            raise DtypeError("TensorDesc", "dtype", "a Dtype or dtype name", repr(dtype)) from None
        object.__setattr__(self, "shape", dims)
        object.__setattr__(self, "dtype", dt)
        object.__setattr__(self, "format", format)
        object.__setattr__(self, "device", str(device))

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def replace(self, **kw: Any) -> "TensorDesc":
        d = {"shape": self.shape, "dtype": self.dtype, "format": self.format, "device": self.device}
        d.update(kw)
        return TensorDesc(**d)

    def __repr__(self) -> str:
        dev = "" if self.device == "cpu" else f", device={self.device!r}"
        return f"TensorDesc({list(self.shape)}, {self.dtype}{dev})"

    @classmethod
    def of(cls, x: Any) -> "TensorDesc":
        """Describe any supported tensor (or return a TensorDesc unchanged)."""
        if isinstance(x, TensorDesc):
            return x
        from .tensor import describe

        return describe(x)
