"""Helpers for the MindSpore tests: seeded inputs as MindSpore tensors, and
``check_ms`` (the MindSpore backend's kernel vs the NumPy reference).

MindSpore is imported here; test modules ``pytest.importorskip("mindspore")`` before
importing this helper, so a machine without MindSpore skips them with the reason shown.
"""

from __future__ import annotations

from typing import Any, Sequence

import mindspore
import numpy as np

import atbcore as atb
from atbcore.numerics import assert_close
from atbcore.tensor import from_numpy, to_numpy

import atb_mindspore  # noqa: F401  (registers the backend and the bridge)
from atb_mindspore.backend import common

FLOATS = ["fp32", "fp16", "bf16"]


def to_ms(x: Any) -> Any:
    """A MindSpore tensor holding a private copy of the NumPy array ``x`` (None stays)."""
    if x is None:
        return None
    return from_numpy(np.array(x, copy=True), "mindspore")


def run(op_name: str, params: dict | None, inputs: Sequence[Any],
        backend: str | None) -> tuple[list, Any]:
    op = atb.Builder(backend=backend).build_operation(op_name, params or {})
    return op.execute(list(inputs)), op


def check_ms(op_name: str, params: dict | None, inputs: Sequence[Any],
             dtypes: Sequence[Any] | None = None, path: str | None = None) -> list:
    """The MindSpore kernel (on MindSpore tensors) vs the NumPy reference (on NumPy
    copies of the same values); every output within DESIGN.md §5, integers exact,
    same dtype and shape. ``path``: a fragment of the recorded implementation path.
    Returns the reference outputs."""
    ref, _ = run(op_name, params, [None if x is None else np.array(x, copy=True) for x in inputs],
                 "numpy")
    got, op = run(op_name, params, [to_ms(x) for x in inputs], "mindspore")
    assert op.last_backend == "mindspore"
    assert len(got) == len(ref), (len(got), len(ref))
    for i, (g, r) in enumerate(zip(got, ref)):
        assert isinstance(g, mindspore.Tensor), type(g)
        g = to_numpy(g)
        assert g.dtype == np.asarray(r).dtype, (op_name, i, g.dtype, np.asarray(r).dtype)
        assert g.shape == np.shape(r), (op_name, i, g.shape, np.shape(r))
        dt = dtypes[i] if dtypes else None
        if dt is None and np.asarray(r).dtype.kind in "biu":
            np.testing.assert_array_equal(g, r, err_msg=f"{op_name} output {i}")
            continue
        assert_close(g, r, dt, what=f"{op_name} output {i} (mindspore vs numpy)")
    if path is not None:
        assert path in common.PATHS[op_name][0], common.PATHS.get(op_name)
    return ref
