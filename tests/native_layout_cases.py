"""The weight-layout pass on the framework-free C kernels' front-ends (NumPy's
``numpy_c``, atb_mindspore, atb_paddle): the seed MLP GraphOp (LayerNorm, Linear,
SiLU, Linear, ResidualAdd; fused to one FusedFeedForward) holds its two projection
weights as 32-output panels only, packed once by the pass (the C kernels' own
packing at binding adds nothing), explain() lists them, and the bound plan, the
node-by-node run and the float64 NumPy reference agree at 1, 5 and 300 rows (300:
past the row count where the C matmul used to hand over to the framework's GEMM)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from atbcore.backends.cpu_kernels import native_panels
from atbcore.graph.packed import PANELS, Layout, PackedWeight, unpack
from atbcore.numerics import assert_close
from atbcore.runtime.profiler import Profiler
from atbcore.tensor import to_numpy
from oracle import rand

H, I = 64, 96
PROJ = ("linear.weight", "linear_1.weight")


def reference(x: np.ndarray, w: dict[str, Any]) -> np.ndarray:
    """The MLP in float64 NumPy, from the graph's logical weights."""
    f = {k: np.asarray(unpack(v) if type(v) is PackedWeight else v, np.float64)
         for k, v in w.items()}
    x = x.astype(np.float64)
    n = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    n = n * f["layer_norm.weight"] + f["layer_norm.bias"]
    h = n @ f["linear.weight"].T + f["linear.bias"]
    h = h / (1 + np.exp(-h))
    return h @ f["linear_1.weight"].T + f["linear_1.bias"] + x


def check_packed_mlp(call: Callable[[Any], Any], to_fw: Callable[[Any], Any],
                     backend: str) -> None:
    """``call`` (a front-end's GraphOp, its core GraphOp made at the first call) runs
    on ``to_fw(x)``."""
    call(to_fw(rand((1, 1, H), "fp32", 0)))
    core = getattr(call, "core", None) or call
    cached = len(native_panels._CACHE)
    wm = core.graph.weight_map
    packed = {t: v for t, v in wm.items() if type(v) is PackedWeight}
    assert set(packed) == set(PROJ), sorted(packed)
    for t, v in packed.items():
        n, k = v.shape
        assert v.layout == Layout(PANELS) and v.nbytes == -(-n // 32) * 32 * k * 4, (t, v)
        assert core.graph_unfused.weight_map[t] is v  # no unpacked twin before fusion
    text = core.explain()
    assert "linear.weight: 32-output panels, 24576 B" in text
    assert "linear_1.weight: 32-output panels, 24576 B" in text
    assert "Weights: 6, " in text
    for rows in (1, 5, 300):
        x = rand((1, rows, H), "fp32", rows)
        got = call(to_fw(x))
        plan = core.last_plan
        assert all(c.backend == backend for c in plan.calls), [c.backend for c in plan.calls]
        prog = list(plan.programs.values())[-1]
        assert all(prog.bound.values()), prog.bound
        assert_close(to_numpy(got), reference(x, wm), "fp32", f"{rows} rows vs float64 NumPy")
        one = plan.run(dict(zip(core.graph.inputs, [to_fw(x)])), profiler=Profiler("t"))[0]
        np.testing.assert_array_equal(to_numpy(one), to_numpy(got))  # node by node: same bits
    assert len(native_panels._CACHE) == cached  # nothing packed beside the pass's panels
