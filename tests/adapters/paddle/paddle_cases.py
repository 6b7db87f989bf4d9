"""Helpers for the Paddle tests: seeded inputs as Paddle tensors, and
``check_paddle`` (the Paddle backend's kernel vs the NumPy reference).

Paddle is imported here; the test modules ``pytest.importorskip("paddle")`` before
importing this helper, so a machine without Paddle skips them with the reason shown.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import paddle

import atbcore as atb
from atbcore.numerics import assert_close
from atbcore.tensor import to_numpy

import atb_paddle.backend as pb

pb.register()

FLOATS = ["fp32", "fp16", "bf16"]


def to_paddle(x: Any) -> Any:
    """A Paddle tensor holding a private copy of the NumPy array ``x`` (None stays)."""
    if x is None:
        return None
    from atbcore.tensor import from_numpy

    return from_numpy(np.array(x, copy=True), "paddle")


def run(op_name: str, params: dict | None, inputs: Sequence[Any], backend: str) -> tuple[list, Any]:
    op = atb.Builder(backend=backend).build_operation(op_name, params or {})
    return op.execute(list(inputs)), op


def check_paddle(op_name: str, params: dict | None, inputs: Sequence[Any],
                 dtypes: Sequence[Any] | None = None) -> list:
    """The Paddle kernel (on Paddle tensors) vs the NumPy reference (on NumPy copies
    of the same values); every output within DESIGN.md §5, integers exact. Returns
    the reference outputs."""
    ref, _ = run(op_name, params, [None if x is None else np.array(x, copy=True) for x in inputs],
                 "numpy")
    got, op = run(op_name, params, [to_paddle(x) for x in inputs], "paddle")
    assert op.last_backend == "paddle"
    assert len(got) == len(ref), (len(got), len(ref))
    for i, (g, r) in enumerate(zip(got, ref)):
        assert isinstance(g, paddle.Tensor), type(g)
        g = to_numpy(g)
        assert g.dtype == np.asarray(r).dtype, (g.dtype, np.asarray(r).dtype)
        assert g.shape == np.shape(r), (g.shape, np.shape(r))
        dt = dtypes[i] if dtypes else None
        if dt is None and np.asarray(r).dtype.kind in "biu":
            np.testing.assert_array_equal(g, r, err_msg=f"{op_name} output {i}")
            continue
        assert_close(g, r, dt, what=f"{op_name} output {i} (paddle vs numpy)")
    return ref
