"""Linear (dense, w8) and MatMul: torch kernels vs the NumPy reference, torch
functional oracles, the weight-only int8 paths, the transposed-weight cache, bad input."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import atbcore as atb
from atbcore.backends.cpu_kernels import torch_ops as ck
from atbcore.backends.torch import weight_layout
from atbcore.backends.torch.linear import transposed_weight_cache, w8_plan
from atbcore.ops.linear import quantize_w8
from atbcore.ops.linear_quant import act_q8
from oracle import FLOATS, check_error, check_op, rand

# (x shape, out_features)
LINEAR_SHAPES = [((3, 769), 33), ((2, 3, 64), 769), ((1, 1, 769), 769), ((2, 1, 2, 5), 7)]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("xs,out", LINEAR_SHAPES, ids=[str(s[0]) for s in LINEAR_SHAPES])
def test_linear_matches_reference(xs, out, dtype):
    k = xs[-1]
    x, w, b = rand(xs, dtype, 1), rand((out, k), dtype, 2, scale=k ** -0.5), rand((out,), dtype, 3)
    check_op("Linear", {}, [x, w])
    ref = check_op("Linear", {"bias": True, "in_features": k, "out_features": out}, [x, w, b])
    assert ref[0].shape == (*xs[:-1], out) and ref[0].dtype == x.dtype
    # weight given [in, out]
    check_op("Linear", {"transpose_weight": False}, [x, np.ascontiguousarray(w.T), b])


def test_linear_fp32_bias_for_half_layer():
    x, w = rand((4, 64), "bf16", 1), rand((32, 64), "bf16", 2)
    check_op("Linear", {}, [x, w, rand((32,), "fp32", 3)])


@pytest.mark.parametrize("panels", ["1", "0"])
@pytest.mark.parametrize("rows", [1, 5])
def test_linear_vs_torch_functional(rows, panels, monkeypatch):
    """fp32 vs F.linear; calls repeat with the same weight so the C matmul's panels
    (or, with ATB_PANELS=0, the cached pre-transposed GEMV) are reused, and an
    in-place weight update is seen."""
    monkeypatch.setenv("ATB_PANELS", panels)
    c_matmul = panels == "1" and ck.unavailable_reason() is None
    torch.manual_seed(0)
    transposed_weight_cache.clear()
    w, b = torch.randn(96, 64), torch.randn(96)
    op = atb.Builder().build_operation("Linear", {"has_bias": True})
    for i in range(3):
        x = torch.randn(rows, 64)
        y, = op.execute([x, w, b])
        atb.assert_close(y, F.linear(x, w, b), "fp32", f"Linear vs F.linear, call {i}")
    assert len(transposed_weight_cache) == (1 if rows == 1 and not c_matmul else 0)
    if c_matmul:
        assert weight_layout.panels(w)[0].shape == (3, 64, 32)  # made once, reused
    with torch.no_grad():
        w.mul_(-2.0)                                   # in place: the cached copy is stale
    x = torch.randn(rows, 64)
    y, = op.execute([x, w, b])
    atb.assert_close(y, F.linear(x, w, b), "fp32", "Linear after an in-place weight update")


def test_transposed_cache_drops_freed_weights(monkeypatch):
    monkeypatch.setenv("ATB_PANELS", "0")  # the cache serves the GEMV without panels
    transposed_weight_cache.clear()
    op = atb.Builder().build_operation("Linear")
    for _ in range(3):
        w = torch.randn(48, 32)
        x = torch.randn(1, 32)
        for _ in range(2):
            y, = op.execute([x, w])
            atb.assert_close(y, F.linear(x, w), "fp32")
        del w
    assert len(transposed_weight_cache) == 0 and transposed_weight_cache.bytes == 0


def test_inference_mode_weights_are_not_cached():
    """Inference tensors have no version counter: they are never cached, still correct."""
    transposed_weight_cache.clear()
    with torch.inference_mode():
        w = torch.randn(48, 32)
    op = atb.Builder().build_operation("Linear")
    for _ in range(2):
        x = torch.randn(1, 32)
        y, = op.execute([x, w])
        atb.assert_close(y, F.linear(x, w), "fp32")
    with torch.inference_mode():
        w.mul_(3.0)
    y, = op.execute([x, w])
    atb.assert_close(y, F.linear(x, w), "fp32", "after an in-place update in inference mode")
    assert len(transposed_weight_cache) == 0


def test_seed_linear_qkv():
    """Seed 8.5: a QKV projection by seed params (fuse_qkv is advisory)."""
    torch.manual_seed(0)
    hidden = 96
    x = torch.randn(2, 5, hidden, dtype=torch.float16)
    w_qkv = torch.randn(3 * hidden, hidden, dtype=torch.float16) * hidden ** -0.5
    op = atb.Builder().build_operation("Linear", {"in_features": hidden, "out_features": 3 * hidden,
                                                  "fuse_qkv": True, "dtype": atb.Dtype.FP16})
    y, = op.execute([x, w_qkv])
    atb.assert_close(y, torch.matmul(x.float(), w_qkv.float().T), "fp16", "seed QKV linear")


# ------------------------------------------------------------------------------ w8


def test_quantize_w8():
    w = rand((5, 40), "fp32", 1)
    w[2] = 0.0
    q, s = quantize_w8(w)
    assert q.dtype == np.int8 and s.dtype == np.float32 and s.shape == (5,)
    np.testing.assert_allclose(s[[0, 1, 3, 4]], np.abs(w[[0, 1, 3, 4]]).max(1) / 127, rtol=1e-6)
    assert np.abs(q).max() == 127 and (q[2] == 0).all()
    assert np.all(np.abs(q * s[:, None] - w) <= s[:, None] / 2 + 1e-7)
    qt, st = quantize_w8(torch.from_numpy(w))
    np.testing.assert_array_equal(qt.numpy(), q)
    np.testing.assert_allclose(st.numpy(), s, rtol=1e-6)


# (rows, in_features): int8pack bf16 needs K % 16; rows > 4 use dequantize + GEMM
W8_SHAPES = [(1, 768), (3, 769), (16, 768), (1, 72), (2049, 64)]


@pytest.mark.parametrize("sdtype", ["fp32", "bf16"])
@pytest.mark.parametrize("xdtype", FLOATS)
@pytest.mark.parametrize("rows,k", W8_SHAPES, ids=[f"{r}x{k}" for r, k in W8_SHAPES])
def test_w8_matches_dequantized_reference(rows, k, xdtype, sdtype):
    n = 40
    x = rand((rows, k), xdtype, 1)
    w32 = rand((n, k), "fp32", 2, scale=k ** -0.5)
    wq, s = quantize_w8(w32)
    s = s.astype(atb.Dtype.of(sdtype).numpy)
    b = rand((n,), xdtype, 3)
    check_op("Linear", {"quant": "w8"}, [x, wq, s])                      # tolerance of x's dtype
    check_op("Linear", {"quant": "w8", "bias": True}, [x.reshape(1, rows, k), wq, b, s])
    # accuracy of w8 itself vs the unquantized fp32 layer
    y, = atb.Builder().build_operation("Linear", {"quant": "w8"}).execute(
        [torch.from_numpy(x.astype(np.float32)).to(atb.Dtype.of(xdtype).torch), torch.from_numpy(wq),
         torch.from_numpy(s.astype(np.float32)).to(atb.Dtype.of(sdtype).torch)])
    full = F.linear(torch.from_numpy(x.astype(np.float32)), torch.from_numpy(w32))
    cos = F.cosine_similarity(y.float().flatten(), full.flatten(), dim=0)
    assert cos >= 0.995, f"w8 cosine {cos:.5f} vs the fp32 layer"


def test_w8_weight_given_in_out():
    x, w32 = rand((3, 64), "fp32", 1), rand((24, 64), "fp32", 2)
    wq, s = quantize_w8(w32)
    a = check_op("Linear", {"quant": "w8"}, [x, wq, s])
    b = check_op("Linear", {"quant": "w8", "transpose_weight": False}, [x, np.ascontiguousarray(wq.T), s])
    np.testing.assert_allclose(a[0], b[0], rtol=1e-6)


def test_w8_plan_paths_and_reasons():
    w = torch.zeros(8, 768, dtype=torch.int8)
    sb, sf = torch.ones(8, dtype=torch.bfloat16), torch.ones(8)
    assert w8_plan(torch.zeros(2, 768, dtype=torch.bfloat16), w, sb, True) == ("int8pack", "")
    path, why = w8_plan(torch.zeros(2, 72, dtype=torch.bfloat16), w[:, :72], sb, True)
    assert path == "int8pack_fp32" and "% 16" in why
    path, why = w8_plan(torch.zeros(2, 768, dtype=torch.bfloat16), w, sf, True)
    assert path == "int8pack_fp32" and "bf16 scales" in why
    path, why = w8_plan(torch.zeros(64, 768), w, sf, True)
    assert path == "dequant" and "64 rows" in why
    assert w8_plan(torch.zeros(1, 768), w.T, sf, False)[0] == "dequant"


def test_w8_bf16_unaligned_activation():
    """The bf16 int8pack kernel needs 32-byte aligned rows: an offset view must work."""
    wq, s = quantize_w8(torch.randn(32, 64))
    buf = torch.randn(1, 64 * 2 + 8).bfloat16()
    x = buf[:, 8:8 + 64]                               # 16 bytes past the allocation start
    y, = atb.Builder().build_operation("Linear", {"quant": "w8"}).execute([x, wq, s.bfloat16()])
    xq = torch.from_numpy(act_q8(x.float().numpy()))   # w8 reads x as int8 blocks of 32
    ref = xq @ (wq.double() * s.bfloat16().double()[:, None]).T
    atb.assert_close(y, ref, "bf16", "w8 on an unaligned bf16 view")


# ------------------------------------------------------------------------------ MatMul

MATMUL_CASES = [
    # (a shape, b shape, params)
    ((5, 7), (7, 3), {}),
    ((2, 5, 7), (2, 7, 769), {}),
    ((2, 1, 5, 7), (4, 7, 3), {}),                      # broadcast batch
    ((3, 7, 5), (3, 3, 7), {"transpose_a": True, "transpose_b": True}),
    ((1, 72), (9, 72), {"transpose_b": True}),
    ((4, 2, 2049, 8), (8, 5), {}),
    ((3, 769), (769, 5), {}),                           # long reductions
    ((2, 3, 2049), (2, 5, 2049), {"transpose_b": True}),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("a_s,b_s,params", MATMUL_CASES, ids=[str(c[0]) + str(c[1]) for c in MATMUL_CASES])
def test_matmul_matches_reference(a_s, b_s, params, dtype):
    a, b = rand(a_s, dtype, 1), rand(b_s, dtype, 2)
    ref = check_op("MatMul", params, [a, b])
    ta, tb = torch.from_numpy(a.astype(np.float64)), torch.from_numpy(b.astype(np.float64))
    want = torch.matmul(ta.transpose(-1, -2) if params.get("transpose_a") else ta,
                        tb.transpose(-1, -2) if params.get("transpose_b") else tb)
    atb.assert_close(ref[0], want, dtype, "MatMul reference vs torch.matmul")


def test_batch_matmul_alias():
    a, b = rand((3, 4, 5), "fp32", 1), rand((3, 5, 2), "fp32", 2)
    ref = check_op("BatchMatMul", {"trans_b": False}, [a, b])
    np.testing.assert_allclose(ref[0], a @ b, rtol=1e-5)


# ------------------------------------------------------------------------------ bad input

X = rand((2, 8), "fp32", 1)
W = rand((4, 8), "fp32", 2)
WQ, SQ = quantize_w8(W)
BAD = [
    # (op, params, inputs, error, fragments)
    ("Linear", {}, [rand((8,), "fp32", 1), W], atb.ShapeError, ["'x' rank", "[8]"]),
    ("Linear", {}, [X, rand((4, 8, 1), "fp32", 2)], atb.ShapeError, ["'weight' rank", "[4, 8, 1]"]),
    ("Linear", {}, [X, rand((4, 7), "fp32", 2)], atb.ShapeError, ["in_features mismatch", "[2, 8]", "7"]),
    ("Linear", {"in_features": 16}, [X, W], atb.ShapeError, ["in_features", "16"]),
    ("Linear", {"out_features": 5}, [X, W], atb.ShapeError, ["out_features", "5", "[4, 8]"]),
    ("Linear", {}, [X, W, rand((5,), "fp32", 3)], atb.ShapeError, ["'bias' shape", "[4]", "[5]"]),
    ("Linear", {}, [X, WQ], atb.DtypeError, ["quant='w8'", "INT8"]),
    ("Linear", {}, [X, rand((4, 8), "fp16", 2)], atb.DtypeError, ["'weight'", "FP32", "FP16"]),
    ("Linear", {}, [X.astype(np.int32), W], atb.DtypeError, ["'x'", "INT32"]),
    ("Linear", {"dtype": "bf16"}, [X, W], atb.DtypeError, ["BF16", "FP32"]),
    ("Linear", {"quant": "w8"}, [X, WQ], atb.InputError, ["'scale' is missing"]),
    ("Linear", {"quant": "w8", "bias": True}, [X, WQ, rand((4,), "fp32", 3)], atb.InputError,
     ["'scale' is missing"]),
    ("Linear", {"quant": "w8"}, [X, W, SQ], atb.DtypeError, ["quant w8", "INT8", "FP32"]),
    ("Linear", {"quant": "w8"}, [X, WQ, SQ[:3]], atb.ShapeError, ["'scale' shape", "[4]", "[3]"]),
    ("Linear", {"quant": "w8"}, [X, WQ, SQ.astype(np.int32)], atb.DtypeError, ["'scale'", "INT32"]),
    ("Linear", {}, [X, W, rand((4,), "fp32", 3), SQ], atb.InputError, ["without quant"]),
    ("Linear", {"bias": True}, [X, W], atb.InputError, ["'bias' is missing"]),
    ("Linear", {"bias": False}, [X, W, rand((4,), "fp32", 3)], atb.InputError, ["bias=False"]),
    ("Linear", {}, [X], atb.InputError, ["number of inputs", "1"]),
    ("Linear", {}, [X, W, W, W, W, W, W], atb.InputError, ["number of inputs", "7"]),
    ("Linear", {}, [X, W, None, None, rand((4, 3), "fp32", 4)], atb.ShapeError,
     ["'residual' shape", "[2, 4]", "[4, 3]"]),
    ("Linear", {}, [X, W, None, None, rand((2, 4), "fp16", 4)], atb.DtypeError,
     ["residual", "FP16"]),
    ("MatMul", {}, [rand((8,), "fp32", 1), W], atb.ShapeError, ["'a' rank", "[8]"]),
    ("MatMul", {}, [X, rand((7, 3), "fp32", 2)], atb.ShapeError, ["inner dims", "K = 8", "[7, 3]"]),
    ("MatMul", {"transpose_b": True}, [X, rand((8, 3), "fp32", 2)], atb.ShapeError, ["inner dims"]),
    ("MatMul", {}, [rand((2, 3, 8), "fp32", 1), rand((4, 8, 2), "fp32", 2)], atb.ShapeError,
     ["broadcast", "[2]", "[4]"]),
    ("MatMul", {}, [X, rand((8, 2), "fp16", 2)], atb.DtypeError, ["'b'", "FP32", "FP16"]),
    ("MatMul", {}, [X.astype(np.int64), X.T.astype(np.int64)], atb.DtypeError, ["'a'", "INT64"]),
    ("MatMul", {}, [X], atb.InputError, ["number of inputs"]),
]


@pytest.mark.parametrize("op,params,inputs,exc,frags", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input(op, params, inputs, exc, frags):
    check_error(op, params, inputs, exc, *frags, outputs=[np.full((2, 4), 3.0, np.float32)])


def test_wrong_outputs():
    check_error("Linear", {}, [X, W], atb.InputError, "number of outputs",
                outputs=[np.zeros((2, 4), np.float32), np.zeros((2, 4), np.float32)])
    check_error("Linear", {}, [X, W], atb.ShapeError, "output", outputs=[np.full((2, 5), 3.0, np.float32)])
    check_error("MatMul", {}, [X, W.T.copy()], atb.DtypeError, "output",
                outputs=[np.full((2, 4), 3.0, np.float16)])


@pytest.mark.parametrize("op,params,frag", [
    ("Linear", {"quant": "w3"}, "quant"),
    ("Linear", {"in_features": 0}, "in_features"),
    ("Linear", {"bias": "yes"}, "bias"),
    ("Linear", {"transpose_c": True}, "transpose_c"),
    ("MatMul", {"transpose_a": "no"}, "transpose_a"),
])
def test_bad_params(op, params, frag):
    check_error(op, params, [], atb.ParamsError, frag, build_error=True)


# ------------------------------------------------------------------ residual in the epilogue


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rows", [1, 3, 70])
def test_linear_residual_matches_reference_and_functional(rows, dtype):
    """``residual`` added to the output: torch kernel (the C matmul's epilogue on the
    CPU) vs the NumPy reference, and fp32 vs F.linear + r; RmsNormLinear too."""
    x, w, b = rand((rows, 96), dtype, 1), rand((40, 96), dtype, 2, scale=96 ** -0.5), \
        rand((40,), dtype, 3)
    r = rand((rows, 40), dtype, 4)
    check_op("Linear", {"bias": True}, [x, w, b, None, r])
    check_op("RmsNormLinear", {"eps": 1e-6}, [x, rand((96,), dtype, 5), w, None, None, r])
    if dtype == "fp32":
        xt, wt, bt, rt = map(torch.from_numpy, (x, w, b, r))
        y, = atb.Builder().build_operation("Linear", {"bias": True}).execute([xt, wt, bt, None, rt])
        atb.assert_close(y, F.linear(xt, wt, bt) + rt, "fp32", "Linear(residual) vs F.linear + r")


def test_numpy_c_linear_residual_matches_reference():
    """The framework-free C binding (numpy_c) adds the residual in the same kernel."""
    x, w, r = rand((3, 64), "fp32", 1), rand((32, 64), "fp32", 2), rand((3, 32), "fp32", 3)
    got, = atb.Builder(backend="numpy_c").build_operation("Linear", {}).execute([x, w, None, None, r])
    ref, = atb.Builder(backend="numpy").build_operation("Linear", {}).execute([x, w, None, None, r])
    atb.assert_close(got, ref, "fp32", "numpy_c Linear(residual) vs reference")
