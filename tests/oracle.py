"""Test helpers: seeded inputs, kernel-vs-reference checks, bad-input checks.

``check_op`` runs an op on the torch backend and on the NumPy reference backend
with the same inputs and asserts every output agrees within DESIGN.md §5.
``check_error`` asserts a call fails with the right AtbError subclass, that the
message names the op, and that a given output tensor keeps its contents.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pytest

import atbcore as atb
from atbcore.dtypes import Dtype
from atbcore.numerics import assert_close

FLOATS = ["fp32", "fp16", "bf16"]


def rand(shape: Sequence[int], dtype: str | Dtype = "fp32", seed: int = 0, scale: float = 1.0,
         low: float | None = None, high: float | None = None) -> np.ndarray:
    """Seeded random array in ``dtype`` (normal, or uniform in [low, high))."""
    rng = np.random.default_rng(seed)
    if low is not None:
        a = rng.uniform(low, high, size=shape)
    else:
        a = rng.standard_normal(size=shape) * scale
    return a.astype(Dtype.of(dtype).numpy)


def as_torch(x: Any) -> Any:
    from atbcore.tensor import to_torch

    return None if x is None else to_torch(np.array(x, copy=True))


def run(op_name: str, params: dict | None, inputs: Sequence[Any], backend: str) -> list:
    op = atb.Builder(backend=backend).build_operation(op_name, params or {})
    return op.execute(list(inputs))


def check_op(op_name: str, params: dict | None, inputs: Sequence[Any],
             dtypes: Sequence[Any] | None = None) -> list:
    """Torch kernel vs NumPy reference on the same (NumPy) inputs; returns the
    reference outputs. ``dtypes`` overrides the tolerance dtype per output."""
    ref = run(op_name, params, [None if x is None else np.array(x, copy=True) for x in inputs],
              "numpy")
    got = run(op_name, params, [as_torch(x) for x in inputs], "torch")
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        dt = dtypes[i] if dtypes else None
        if dt is None and np.asarray(r).dtype.kind in "biu":
            np.testing.assert_array_equal(g.numpy(), r, err_msg=f"{op_name} output {i}")
            continue
        assert_close(g, r, dt, what=f"{op_name} output {i} (torch vs numpy)")
    return ref


def check_error(op_name: str, params: dict | None, inputs: Sequence[Any], exc: type,
                *fragments: str, backend: str = "torch", outputs: Sequence[Any] | None = None,
                build_error: bool = False) -> atb.AtbError:
    """Assert an AtbError subclass naming the op; given outputs stay untouched."""
    if build_error:
        with pytest.raises(exc) as ei:
            atb.Builder(backend=backend).build_operation(op_name, params or {})
    else:
        op = atb.Builder(backend=backend).build_operation(op_name, params or {})
        ins = [as_torch(x) if backend == "torch" else x for x in inputs]
        outs = None
        before = None
        if outputs is not None:
            outs = [as_torch(o) if backend == "torch" else np.array(o, copy=True) for o in outputs]
            before = [np.array(atb.tensor.to_numpy(o), copy=True) for o in outs]
        with pytest.raises(exc) as ei:
            op.execute(ins, outs)
        if outs is not None:
            for o, b in zip(outs, before):
                np.testing.assert_array_equal(atb.tensor.to_numpy(o), b,
                                              err_msg="output changed by a failed call")
    err = ei.value
    assert isinstance(err, atb.AtbError)
    msg = str(err)
    assert op_name.lower() in msg.lower() or err.op.lower() == op_name.lower() or err.op == "Builder", msg
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return err
