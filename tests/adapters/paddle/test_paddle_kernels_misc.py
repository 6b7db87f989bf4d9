"""Paddle backend kernels vs the NumPy reference: activations, softmax, FFN, MoE,
elementwise, shape and index ops (Paddle tensors in and out)."""

import numpy as np
import pytest

pytest.importorskip("paddle", reason="paddlepaddle is not installed")

import atbcore as atb  # noqa: E402
from oracle import rand  # noqa: E402
from paddle_cases import FLOATS, check_paddle, to_paddle  # noqa: E402

from atb_paddle.backend.common import PATHS, reset_paths  # noqa: E402


@pytest.mark.parametrize("dtype", FLOATS)
def test_activations(dtype, kernel_path):
    reset_paths()
    x = rand((3, 5, 40), dtype, 1, scale=3.0)
    for op, params in (("Gelu", {}), ("Gelu", {"approximate": "tanh"}), ("QuickGelu", {}),
                       ("SiLU", {}), ("Relu", {}), ("SwiGLU", {}), ("GeGLU", {}),
                       ("GeGLU", {"approximate": "tanh"})):
        check_paddle(op, params, [x])
    check_paddle("SwiGLU", {}, [x, rand((3, 5, 40), dtype, 2)])
    for name in ("gelu", "gelu_tanh", "quick_gelu", "silu", "swish", "relu", "swiglu", "geglu"):
        check_paddle("Activation", {"activation_type": name}, [x])
    if kernel_path == "native":  # atb's C kernel ran on the Paddle tensors
        assert PATHS[("SwiGLU", "native")] == 2 and PATHS[("SwiGLU", "swiglu")] == 0
        return
    assert PATHS[("SwiGLU", "swiglu")] >= 3        # Paddle's fused swiglu (on fp32 data)
    assert PATHS[("SwiGLU", "composed")] == 0


def test_activation_without_paddle_function_falls_back_with_reason():
    from atbcore.ops.activation import register_activation, unregister_activation

    register_activation("cube_test", lambda a: a ** 3, lambda t: t ** 3)
    try:
        op = atb.Builder().build_operation("Activation", {"activation_type": "cube_test"})
        x = rand((2, 4), "fp32", 1)
        y, = op.execute([to_paddle(x)])
        assert op.last_backend != "paddle"
        assert any(b == "paddle" and "no Paddle function" in r[0] for b, r in op.last_fallbacks)
        np.testing.assert_allclose(atb.tensor.to_numpy(y), x ** 3, rtol=1e-6)
    finally:
        unregister_activation("cube_test")


@pytest.mark.parametrize("dtype", FLOATS)
def test_softmax(dtype, kernel_path):
    x = rand((2, 3, 6, 9), dtype, 1, scale=4.0)
    check_paddle("Softmax", {}, [x])
    check_paddle("Softmax", {"dim": [1, 3]}, [x])
    check_paddle("ScaledMaskedSoftmax", {"scale": 0.5, "causal": True}, [x])
    check_paddle("ScaledMaskedSoftmax", {"scale": 0.5}, [x, rand((6, 9), dtype, 2)])
    keep = np.random.default_rng(3).random((2, 1, 6, 9)) > 0.4
    keep[:, :, 2] = False                                      # fully masked row -> zeros
    ref, = check_paddle("ScaledMaskedSoftmax", {}, [x, keep])
    assert not np.asarray(ref, np.float32)[:, :, 2].any()


FFN_CASES = [
    ({"activation_type": "swiglu"}, ["gate_w", "up_w", "down_w"]),
    ({"activation_type": "swiglu", "gate_up_merged": True}, ["gate_up_w", "down_w"]),
    ({"activation_type": "gelu", "bias": True}, ["up_w", "down_w", "up_b", "down_b"]),
    ({"activation_type": "geglu", "has_residual": True}, ["gate_w", "up_w", "down_w", "residual"]),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("params,names", FFN_CASES)
def test_fused_feed_forward(dtype, params, names, kernel_path):
    h, i = 24, 40
    shapes = {"gate_w": (i, h), "up_w": (i, h), "down_w": (h, i), "gate_up_w": (2 * i, h),
              "up_b": (i,), "down_b": (h,), "residual": (2, 3, h)}
    ins = [rand((2, 3, h), dtype, 0)] + [rand(shapes[n], dtype, k + 1, scale=0.3)
                                          for k, n in enumerate(names)]
    check_paddle("FusedFeedForward", params, ins)


def test_fused_feed_forward_seed_layout_weights():
    """The seed article's [in, out] weights are accepted transposed."""
    h, i = 24, 40
    x = rand((5, h), "fp32", 0)
    g, u, d = (rand(s, "fp32", k, scale=0.3) for k, s in enumerate([(h, i), (h, i), (i, h)], 1))
    check_paddle("FusedFeedForward", {}, [x, g, u, d])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_moe(dtype):
    e, h, i = 6, 16, 24
    x = rand((3, 5, h), dtype, 0)
    ins = [x, rand((e, h), dtype, 1), rand((e, 2 * i, h), dtype, 2, scale=0.3),
           rand((e, h, i), dtype, 3, scale=0.3)]
    check_paddle("MoE", {"top_k": 2}, ins)
    check_paddle("MoE", {"top_k": 3, "norm_topk_prob": False}, ins)


@pytest.mark.parametrize("dtype", FLOATS)
def test_elewise_float(dtype):
    x, y = rand((3, 4), dtype, 1), rand((4,), dtype, 2)
    for t in ("add", "sub", "mul", "div"):
        check_paddle("Elewise", {"elewise_type": t}, [x, y])
    for t in ("neg", "cos", "sin", "tanh", "exp"):
        check_paddle("Elewise", {"elewise_type": t}, [x])
    check_paddle("Elewise", {"elewise_type": "rsqrt"}, [np.abs(x) + np.asarray(0.5, x.dtype)])
    check_paddle("Elewise", {"elewise_type": "muls", "var_attr": 0.37}, [x])
    check_paddle("ResidualAdd", {}, [x, rand((3, 4), dtype, 3)])
    for out in ("fp32", "fp16", "bf16", "int32"):
        check_paddle("Elewise", {"elewise_type": "cast", "out_dtype": out}, [x * 10])


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32, np.int64])
def test_elewise_int_wraps_around(dtype):
    info = np.iinfo(dtype)
    x = np.array([[info.max, info.min, 3, 100]], dtype)
    y = np.array([[1, -1 if info.min < 0 else 1, 7, 3]], dtype)
    for t in ("add", "sub", "mul"):
        check_paddle("Elewise", {"elewise_type": t}, [x, y])
    if info.min < 0:
        check_paddle("Elewise", {"elewise_type": "neg"}, [x])
    check_paddle("Elewise", {"elewise_type": "cast", "out_dtype": "fp32"}, [x])


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "int8", "int64"])
def test_shape_and_index_ops(dtype):
    x = rand((2, 3, 4, 5), "fp32", 1, scale=20).astype(atb.Dtype.of(dtype).numpy)
    check_paddle("Transpose", {"perm": [0, 2, 1, 3]}, [x])
    check_paddle("Transpose", {"perm": [0, 1, 2, 3]}, [x])
    check_paddle("Reshape", {"shape": [6, -1]}, [x])
    check_paddle("Split", {"dim": 2, "num": 2}, [x])
    check_paddle("Split", {"dim": -1, "sizes": [1, 3, 1]}, [x])
    check_paddle("Concat", {"dim": 1}, [x, x[:, :1], x])
    check_paddle("Concat", {"dim": 0}, [x])
    check_paddle("Slice", {"offsets": [0, 1, -2, 0], "sizes": [-1, 2, 2, 3]}, [x])
    idx = np.array([[3, 0], [1, 1]], np.int64)
    check_paddle("Gather", {"axis": 2}, [x, idx])
    check_paddle("Gather", {"axis": -1}, [x, idx.astype(np.int32)])
    table = x.reshape(24, 5)
    check_paddle("Embedding", {}, [table, np.array([[0, 23, 5]], np.int32)])


def test_reshape_is_a_view_and_others_are_fresh():
    import paddle

    x = to_paddle(rand((2, 6), "fp32", 1))
    y, = atb.Builder(backend="paddle").build_operation("Reshape", {"shape": [3, 4]}).execute([x])
    y[0, 0] = 123.0
    assert float(x[0, 0]) == 123.0                          # the output aliases the input
    for op, params in (("Transpose", {"perm": [0, 1]}), ("Split", {"dim": 0, "num": 2}),
                       ("Slice", {"offsets": [0, 0], "sizes": [-1, -1]}), ("Concat", {"dim": 0})):
        outs = atb.Builder(backend="paddle").build_operation(op, params).execute([x])
        outs[0][0, 0] = -1.0
        assert float(x[0, 0]) == 123.0, op                   # never a view
        assert isinstance(outs[0], paddle.Tensor)


@pytest.mark.parametrize("dtype", FLOATS)
def test_reductions_and_fused_ops(dtype):
    x = rand((3, 4, 8), dtype, 1)
    check_paddle("ReduceMean", {"dim": -1, "keepdim": True}, [x])
    check_paddle("ReduceSum", {"dim": [0, 2]}, [x])
    w, b = rand((12, 8), dtype, 2), rand((12,), dtype, 3)
    check_paddle("LinearActivation", {"activation_type": "gelu"}, [x, w, b])
    q, k = rand((2, 6, 4 * 8), dtype, 4), rand((2, 6, 2 * 8), dtype, 5)
    params = {"num_heads": 4, "num_kv_heads": 2, "causal": True, "rotary_type": "half"}
    check_paddle("RopeFlashAttention", params, [q, k, k])
    check_paddle("RopeFlashAttention", params, [rand((2, 6, 8 * 8), dtype, 6)])   # packed QKV
    check_paddle("AllReduce", {}, [x])


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int32"])
def test_argmax_sampling_and_padding(dtype):
    x = (rand((4, 50), "fp32", 1, scale=3) * (10 if dtype == "int32" else 1)).astype(
        atb.Dtype.of(dtype).numpy)
    check_paddle("Argmax", {}, [x])
    check_paddle("Argmax", {"dim": 0, "keepdim": True}, [x])
    if dtype != "int32":
        for params in ({"seed": 3}, {"top_k": 5, "seed": 4}, {"top_p": 0.7, "temperature": 0.8, "seed": 5},
                       {"temperature": 0.0}):
            check_paddle("TopkToppSampling", params, [x])
    lens = np.array([3, 0, 5], np.int32)
    seq = rand((3, 5, 2), "fp32", 2).astype(atb.Dtype.of(dtype).numpy)
    for side in ("right", "left"):
        packed, cu = check_paddle("Unpad", {"padding_side": side}, [seq, lens])
        check_paddle("Pad", {"padding_side": side, "pad_value": 7.0}, [packed, lens])
        check_paddle("Pad", {"padding_side": side, "max_seq_len": 6}, [packed, lens])


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
    ref = check_paddle("RopeKVCache", {"num_heads": hq, "num_kv_heads": hk, "head_dim": d}, ins)
    assert np.count_nonzero(ref[1].reshape(-1, hk * d).any(axis=1)) == b * s
