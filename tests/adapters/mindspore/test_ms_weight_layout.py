"""The weight-layout pass on atb_mindspore (PyNative): the seed MLP GraphOp on
MindSpore CPU tensors holds its projections as the C kernels' panels only, packed
once by the pass, and matches float64 NumPy bound and node by node
(tests/native_layout_cases.py)."""

import pytest

pytest.importorskip("mindspore", reason="mindspore is not installed")

from ms_cases import to_ms  # noqa: E402

from atbcore.backends.cpu_kernels import available  # noqa: E402
from native_layout_cases import H, I, check_packed_mlp  # noqa: E402

import atb_mindspore as atb  # noqa: E402

pytestmark = pytest.mark.skipif(not available(), reason="the C kernels did not build here")


def test_mindspore_mlp_holds_panels_only():
    mlp = atb.GraphOp([atb.LayerNorm(eps=1e-5), atb.Linear(out_features=I), atb.SiLU(),
                       atb.Linear(out_features=H), atb.ResidualAdd()])
    check_packed_mlp(mlp, to_ms, "mindspore")
