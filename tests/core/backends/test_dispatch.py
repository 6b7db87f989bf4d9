"""Capability dispatch: first backend without reasons wins; fallbacks are logged."""

import logging
import subprocess
import sys

import numpy as np
import pytest

import atbcore as atb
from atbcore.backends import backends, get_backend, register_backend, select_backend
from atbcore.backends.base import Backend, Kernel
from atbcore.ops import get_op


def test_atbcore_imports_no_framework():
    code = ("import sys, atbcore, atbcore.ops; atbcore.list_operations();"
            "bad=[m for m in ('torch','mindspore','paddle') if m in sys.modules]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_priority_order_and_reference_always_available():
    names = [b.name for b in backends()]
    assert names.index("torch") < names.index("numpy")
    assert get_backend("numpy").available()
    for op in atb.list_operations():
        assert get_backend("numpy").kernel(op) is not None, op


def test_fallback_is_logged_with_reason(caplog):
    class Picky(Backend):
        def load(self):
            self.kernels = {"RmsNorm": Kernel("RmsNorm", fn=lambda p, ins: [],
                                              check=lambda p, ins: ["hidden 769 is not a multiple of 16"])}

    register_backend(Picky(name="picky", priority=1))
    try:
        opdef = get_op("RmsNorm")
        p = opdef.make_params({})
        descs = {"x": atb.TensorDesc([2, 769]), "weight": atb.TensorDesc([769])}
        with caplog.at_level(logging.INFO, logger="atb"):
            b, skipped = select_backend(opdef, p, descs)
        assert b.name == "torch"
        assert skipped == [("picky", ["hidden 769 is not a multiple of 16"])]
        assert "RmsNorm: picky skipped (hidden 769 is not a multiple of 16) -> torch" in caplog.text
        op = atb.Builder().build_operation("RmsNorm")
        x, w = np.ones((2, 769), np.float32), np.ones(769, np.float32)
        op.execute([x, w])
        assert op.last_backend == "torch" and op.last_fallbacks[0][0] == "picky"
    finally:
        from atbcore import backends as reg

        reg._BACKENDS.pop("picky")


def test_forced_backend_and_capability_error(monkeypatch):
    op = atb.Builder(backend="numpy").build_operation("RmsNorm")
    x, w = np.ones((2, 8), np.float32), np.ones(8, np.float32)
    op.execute([x, w])
    assert op.last_backend == "numpy"
    monkeypatch.setenv("ATB_BACKEND", "numpy")
    op2 = atb.Builder().build_operation("RmsNorm")
    op2.execute([x, w])
    assert op2.last_backend == "numpy"
    with pytest.raises(atb.CapabilityError, match="unknown backend"):
        atb.Builder(backend="tpu").build_operation("RmsNorm").execute([x, w])


def test_device_tensor_on_numpy_backend_is_refused():
    opdef = get_op("RmsNorm")
    reasons = get_backend("numpy").not_supported_reasons(
        opdef, opdef.make_params({}), {"x": atb.TensorDesc([2, 8], device="cuda:0"),
                                       "weight": atb.TensorDesc([8], device="cuda:0")})
    assert reasons and "cuda:0" in reasons[0]


def test_destroyed_operation_and_context_manager():
    with atb.Builder().build_operation("RmsNorm") as op:
        pass
    with pytest.raises(atb.AtbError, match="destroyed"):
        op.execute([np.ones((1, 4), np.float32), np.ones(4, np.float32)])
    atb.destroy_operations([atb.Builder().build_operation("LayerNorm")])
