"""``Dtype``: the element types atb knows, and their framework equivalents.

NumPy has no bfloat16; ``ml_dtypes.bfloat16`` stands in for it so the NumPy
reference can hold bf16 tensors bit-exactly.
"""

from __future__ import annotations

import enum
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["Dtype"]

_NP = {
    "FP32": np.dtype(np.float32),
    "FP16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "INT8": np.dtype(np.int8),
    "UINT8": np.dtype(np.uint8),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "BOOL": np.dtype(np.bool_),
    "FP64": np.dtype(np.float64),
}


class Dtype(enum.Enum):
    """Element type of a tensor. ``Dtype.FP16``, ``Dtype.BF16``, ..."""

    FP32 = "float32"
    FP16 = "float16"
    BF16 = "bfloat16"
    INT8 = "int8"
    UINT8 = "uint8"
    INT32 = "int32"
    INT64 = "int64"
    BOOL = "bool"
    FP64 = "float64"

    def __repr__(self) -> str:
        return f"Dtype.{self.name}"

    __str__ = __repr__

    @property
    def numpy(self) -> np.dtype:
        """The NumPy dtype (``ml_dtypes.bfloat16`` for BF16)."""
        return _NP[self.name]

    @property
    def torch(self) -> Any:
        """The torch dtype (imports torch)."""
        import torch

        return getattr(torch, self.value)

    @property
    def is_floating(self) -> bool:
        return self in (Dtype.FP32, Dtype.FP16, Dtype.BF16, Dtype.FP64)

    @property
    def is_integer(self) -> bool:
        return self in (Dtype.INT8, Dtype.UINT8, Dtype.INT32, Dtype.INT64)

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @classmethod
    def of(cls, value: Any) -> "Dtype":
        """Coerce a Dtype, a name ("fp16", "float16", "bf16"), a NumPy, torch,
        MindSpore or Paddle dtype into a :class:`Dtype`."""
        if isinstance(value, Dtype):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            for prefix in ("torch.", "paddle.", "mindspore.", "np.", "numpy."):
                if key.startswith(prefix):
                    key = key[len(prefix):]
            key = _NAME_ALIASES.get(key, key)
            for d in cls:
                if d.value == key or d.name.lower() == key:
                    return d
            raise ValueError(f"unknown dtype {value!r}")
        try:
            npd = np.dtype(value)
        except TypeError:
            npd = None
        if npd is not None:
            for d in cls:
                if _NP[d.name] == npd:
                    return d
        # torch / mindspore / paddle dtypes print as "torch.float16", "Float16", "paddle.float16"
        return cls.of(str(value))


_NAME_ALIASES = {
    "float": "float32",
    "fp32": "float32",
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
    "double": "float64",
    "fp64": "float64",
    "long": "int64",
    "int": "int32",
    "bool_": "bool",
    "float32_t": "float32",
}
