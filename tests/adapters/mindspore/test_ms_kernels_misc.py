"""The MindSpore backend's kernels vs the NumPy reference for activations, softmax,
FusedFeedForward, the fused ops, elementwise, shape and index ops; and how the
backend takes part in dispatch (asked first for MindSpore tensors, falling back
with a logged reason where it has no formula or kernel)."""

import logging

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="mindspore is not installed")

import atbcore as atb  # noqa: E402
from atbcore.ops.activation import register_activation, unregister_activation  # noqa: E402
from ms_cases import FLOATS, check_ms, to_ms  # noqa: E402
from oracle import rand  # noqa: E402


@pytest.mark.parametrize("dt", FLOATS)
def test_activations_and_softmax(dt, kernel_path):
    x, y = rand([2, 3, 8], dt, 1, 2.0), rand([2, 3, 8], dt, 2)
    for op in ["Gelu", "QuickGelu", "SiLU", "Relu", "SwiGLU", "GeGLU"]:
        check_ms(op, {}, [x])
    check_ms("Gelu", {"approximate": "tanh"}, [x])
    check_ms("SwiGLU", {}, [x, y])
    for act in ["gelu_tanh", "geglu", "swish", "quick_gelu"]:
        check_ms("Activation", {"activation_type": act}, [x])
    check_ms("Softmax", {}, [x])
    check_ms("Softmax", {"dim": [1, 2]}, [x])
    check_ms("ScaledMaskedSoftmax", {"scale": 0.5, "causal": True}, [x])
    check_ms("ScaledMaskedSoftmax", {"scale": 0.5}, [x, rand([3, 8], "fp32", 5) > 0])
    check_ms("ScaledMaskedSoftmax", {}, [x, rand([1, 3, 8], dt, 6)])


def test_masked_rows_are_zero_not_nan():
    x = rand([2, 4], "fp32", 1)
    mask = np.array([[True] * 4, [False] * 4])
    y, = check_ms("ScaledMaskedSoftmax", {}, [x, mask])
    assert np.all(y[1] == 0)


@pytest.mark.parametrize("dt", FLOATS)
def test_ffn_and_fused_ops(dt, kernel_path):
    H, I = 12, 20
    x = rand([2, 3, H], dt, 1)
    g, u, d = rand([I, H], dt, 2, 0.3), rand([I, H], dt, 3, 0.3), rand([H, I], dt, 4, 0.3)
    check_ms("FusedFeedForward", {}, [x, g, u, d])
    check_ms("FusedFeedForward", {"gate_up_merged": True}, [x, np.concatenate([g, u]), d])
    check_ms("FusedFeedForward", {"activation_type": "gelu", "has_residual": True}, [x, u, d, x])
    check_ms("FusedFeedForward", {"bias": True}, [x, g, u, d, rand([I], dt, 5), rand([I], dt, 6),
                                                 rand([H], dt, 7)])
    check_ms("FusedFeedForward", {}, [x, g.T.copy(), u.T.copy(), d.T.copy()])  # seed [in, out]
    check_ms("LinearActivation", {"activation_type": "gelu_tanh"}, [x, u, rand([I], dt, 5)])
    q, k, v = rand([2, 5, 32], dt, 6), rand([2, 5, 16], dt, 7), rand([2, 5, 16], dt, 8)
    hp = {"num_heads": 4, "num_kv_heads": 2, "causal": True}
    check_ms("RopeFlashAttention", hp, [q, k, v])
    check_ms("RopeFlashAttention", hp, [np.concatenate([q, k, v], -1)])


@pytest.mark.parametrize("dt", FLOATS)
def test_elementwise(dt):
    x, y = rand([2, 3, 8], dt, 1), rand([2, 3, 8], dt, 2)
    for t in ["add", "sub", "mul", "div"]:
        check_ms("Elewise", {"elewise_type": t}, [x, y])
    check_ms("Elewise", {"elewise_type": "add"}, [x, y[:1, :, :1]])   # broadcasting
    for t in ["neg", "cos", "sin", "tanh", "exp"]:
        check_ms("Elewise", {"elewise_type": t}, [x])
    check_ms("Elewise", {"elewise_type": "rsqrt"}, [np.abs(x) + 0.5])
    check_ms("Elewise", {"elewise_type": "muls", "scalar": 0.3}, [x])
    check_ms("Elewise", {"elewise_type": "cast", "out_dtype": "fp32"}, [x])
    check_ms("Elewise", {"elewise_type": "cast", "out_dtype": "int32"}, [x * 10])
    check_ms("ResidualAdd", {}, [x, y])


def test_integer_elementwise_and_8bit_fallback():
    a = np.arange(12, dtype=np.int32).reshape(3, 4)
    check_ms("Elewise", {"elewise_type": "add"}, [a, a])
    check_ms("Elewise", {"elewise_type": "neg"}, [a.astype(np.int64)])
    i8 = np.array([100, -100, 7], np.int8)
    op = atb.Builder().build_operation("Elewise", {"elewise_type": "add"})
    out, = op.execute([to_ms(i8), to_ms(i8)])
    assert op.last_backend != "mindspore" and "INT8" in op.last_fallbacks[0][1][0]
    np.testing.assert_array_equal(atb.tensor.to_numpy(out), (i8 + i8))  # wraps like NumPy


@pytest.mark.parametrize("dt", FLOATS)
def test_shape_and_index_ops(dt):
    x, y = rand([2, 3, 8], dt, 1), rand([2, 3, 8], dt, 2)
    check_ms("Transpose", {"perm": [2, 0, 1]}, [x])
    check_ms("Transpose", {"perm": [0, 1, 2]}, [x])
    check_ms("Reshape", {"shape": [6, -1]}, [x])
    check_ms("Split", {"sizes": [3, 5]}, [x])
    check_ms("Split", {"num": 2, "dim": 0}, [x])
    check_ms("Concat", {"dim": 1}, [x, y, x])
    check_ms("Slice", {"offsets": [0, 1, 2], "sizes": [-1, 2, 4]}, [x])
    check_ms("Gather", {"axis": 1}, [x, np.array([[2, 0], [1, 1]], np.int64)])
    check_ms("Embedding", {}, [rand([10, 4], dt, 3), np.array([[1, 9, 0]], np.int32)])


def test_reshape_is_a_view_and_others_are_fresh():
    x = to_ms(rand([2, 6], "fp32", 1))
    r, = atb.Builder(backend="mindspore").build_operation("Reshape", {"shape": [3, 4]}).execute([x])
    assert r.data_ptr() == x.data_ptr()
    for name, params in [("Transpose", {"perm": [0, 1]}), ("Split", {"num": 1, "dim": 0}),
                         ("Concat", {}), ("Slice", {"offsets": [0, 0], "sizes": [-1, -1]})]:
        out = atb.Builder(backend="mindspore").build_operation(name, params).execute([x])[0]
        assert out.data_ptr() != x.data_ptr(), name


def test_mindspore_tensors_dispatch_to_mindspore_first():
    """Without forcing a backend, MindSpore inputs run on MindSpore kernels although
    torch has the higher priority (native_first); NumPy inputs still go to torch."""
    x, w = rand([2, 8], "fp32", 1), rand([8], "fp32", 2)
    op = atb.Builder().build_operation("RmsNorm")
    out, = op.execute([to_ms(x), to_ms(w)])
    assert op.last_backend == "mindspore" and isinstance(out, ms.Tensor)
    op.execute([x, w])
    assert op.last_backend != "mindspore"


def test_plugin_activation_falls_back_with_reason(caplog):
    """An activation only a plugin defines has no MindSpore formula: dispatch falls
    back (logged with the reason) and the result is still right."""
    register_activation("squareplus_ms", lambda x: (x + np.sqrt(x * x + 4)) / 2,
                        lambda x: (x + (x * x + 4).sqrt()) / 2)
    try:
        x = rand([3, 5], "fp32", 1)
        op = atb.Builder().build_operation("Activation", {"activation_type": "squareplus_ms"})
        with caplog.at_level(logging.INFO, logger="atb"):
            out, = op.execute([to_ms(x)])
        assert op.last_fallbacks[0][0] == "mindspore"
        assert "no MindSpore formula" in op.last_fallbacks[0][1][0]
        assert "no MindSpore formula" in caplog.text
        np.testing.assert_allclose(atb.tensor.to_numpy(out), (x + np.sqrt(x * x + 4)) / 2, rtol=1e-5)
    finally:
        unregister_activation("squareplus_ms")


def test_ascend_only_fused_kernels_are_not_used_on_cpu():
    """On the CPU the Ascend-only fused kernels are skipped for the composition, and
    the reason is recorded (and logged at DEBUG)."""
    from atb_mindspore.backend.common import PATHS

    from atbcore.backends.cpu_kernels.native_kernels import native_off

    x, w = rand([2, 8], "fp32", 1), rand([8], "fp32", 2)
    with native_off():  # else atb's C kernel runs (test_ms_native.py)
        check_ms("RmsNorm", {}, [x, w])
    assert PATHS["RmsNorm"][1] == "ops.rms_norm is Ascend-only"
    q = rand([1, 4, 32], "fp16", 3)
    check_ms("FlashAttention", {"num_heads": 2}, [q, q, q])
    assert "Ascend-only" in PATHS["FlashAttention"][1]
    with native_off():
        check_ms("RoPE", {"num_heads": 2}, [q])
    assert "Ascend-only" in PATHS["RoPE"][1]


@pytest.mark.parametrize("slots", [False, True])
def test_rope_kv_cache_by_position_and_by_slot(slots):
    """RopeKVCache (the rope_cache fusion's op) composed of the backend's RoPE and
    cache write: q rotated, k rotated and v written at each token's row."""
    b, s, hq, hk, d = 2, 3, 4, 2, 8
    q, k, v = rand([b, s, hq * d], "fp32", 1), rand([b, s, hk * d], "fp32", 2), \
        rand([b, s, hk * d], "fp32", 3)
    pos = np.array([[0, 1, 2], [4, 5, 6]])
    ins = [q, k, v, np.zeros((b, 8, hk, d), np.float32), np.zeros((b, 8, hk, d), np.float32), pos]
    if slots:
        ins += [None, None, np.array([1, 2, 3, 9, 10, 14], np.int32)]
    ref = check_ms("RopeKVCache", {"num_heads": hq, "num_kv_heads": hk, "head_dim": d}, ins)
    assert np.count_nonzero(ref[1].reshape(-1, hk * d).any(axis=1)) == b * s
