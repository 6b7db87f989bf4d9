"""The framework-free C kernel bindings (cpu_kernels.native*): views read without a
copy (DLPack and the array interface agree with the tensor's own address), the C
steps against the NumPy reference, bad views refused with AtbError subclasses before
any C call, and the ``numpy_c`` backend (kernels, fallbacks, bound plans)."""

import numpy as np
import pytest

import atbcore as atb
from atbcore.backends import get_backend
from atbcore.backends.cpu_kernels import available
from atbcore.backends.cpu_kernels.native import NativeView, array_view, dlpack_view, view_of
from atbcore.backends.cpu_kernels.native_ops import (Ref, activation_steps, compile_steps,
                                                     copy_step, layer_norm_steps, linear_steps,
                                                     rms_norm_steps, softmax_steps)
from atbcore.dtypes import Dtype
from atbcore.errors import AtbError, DeviceError, DtypeError, InputError, ShapeError
from atbcore.numerics import assert_close
from oracle import FLOATS, rand, run

pytestmark = pytest.mark.skipif(not available(), reason="the C kernels did not build here")


def _f64(a):
    return np.asarray(a, np.float64)


def test_numpy_views_are_zero_copy_and_match_dlpack():
    a = rand((4, 6, 8), "fp32", 1)[:, 1:5, ::2]          # strided, offset view
    for v in (array_view(a), view_of(a), dlpack_view(a)):
        assert v.address == a.__array_interface__["data"][0]
        assert v.shape == (4, 4, 4) and v.strides == (48, 8, 2) and v.dtype is Dtype.FP32
        assert not v.contiguous
    b = rand((3, 5), "bf16", 2)
    assert view_of(b).dtype is Dtype.BF16 and view_of(b).contiguous


def test_torch_views_are_zero_copy_and_match_dlpack():
    torch = pytest.importorskip("torch")
    t = torch.arange(24, dtype=torch.float16).reshape(2, 3, 4).transpose(0, 2)
    v, d = view_of(t), dlpack_view(t)
    assert v.address == d.address == t.data_ptr()
    assert v.shape == d.shape == (4, 3, 2) and v.strides == d.strides == (1, 4, 12)
    assert v.dtype is d.dtype is Dtype.FP16


def test_dlpack_refuses_what_it_cannot_read():
    with pytest.raises(InputError, match="native view"):
        dlpack_view([1, 2, 3])
    with pytest.raises(DtypeError, match="byte order"):
        view_of(np.ones(4, ">f4"))
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        with pytest.raises(DeviceError):
            dlpack_view(torch.ones(2, device="cuda"))


@pytest.mark.parametrize("dt", FLOATS)
def test_steps_against_the_reference(dt):
    x, r = rand((3, 2, 40), dt, 1), rand((3, 2, 40), dt, 2)
    w, b = rand((40,), dt, 3), rand((40,), dt, 4)
    y, s = np.empty_like(x), np.empty_like(x)
    compile_steps(rms_norm_steps(view_of(x), view_of(w), view_of(r), 40, 1e-6, 0.0,
                                 view_of(y), view_of(s)))({})
    ref_y, ref_s = run("AddRmsNorm", {"eps": 1e-6}, [x, r, w], "numpy")
    assert_close(y, ref_y, dt, "AddRmsNorm y")
    np.testing.assert_array_equal(_f64(s), _f64(ref_s))
    compile_steps(layer_norm_steps(view_of(x), view_of(w), view_of(b), None, 40, 1e-5,
                                   view_of(y)))({})
    assert_close(y, run("LayerNorm", {"eps": 1e-5}, [x, w, b], "numpy")[0], dt, "LayerNorm")
    wl, bl = rand((24, 40), dt, 5, 0.3), rand((24,), dt, 6)
    yl = np.empty((3, 2, 24), x.dtype)
    compile_steps(linear_steps(view_of(x), view_of(wl), view_of(bl), view_of(yl)))({})
    assert_close(yl, run("Linear", {}, [x, wl, bl], "numpy")[0], dt, "Linear")
    h = np.empty((3, 2, 20), x.dtype)
    compile_steps(activation_steps(view_of(x), "silu", view_of(h), split=True))({})
    assert_close(h, run("SwiGLU", {}, [x], "numpy")[0], dt, "SwiGLU")
    compile_steps(softmax_steps(view_of(x), view_of(y)))({})
    assert_close(y, run("Softmax", {}, [x], "numpy")[0], dt, "Softmax")


def test_bound_steps_read_per_run_addresses():
    w = rand((16,), "fp32", 1)
    x = NativeView(Ref("x"), (2, 16), (16, 1), Dtype.FP32)
    y = NativeView(Ref("y"), (2, 16), (16, 1), Dtype.FP32)
    run_ = compile_steps(rms_norm_steps(x, view_of(w), None, 16, 1e-6, 0.0, y))
    for seed in (2, 3):
        a, out = rand((2, 16), "fp32", seed), np.empty((2, 16), np.float32)
        run_({"x": a.ctypes.data, "y": out.ctypes.data})
        assert_close(out, run("RmsNorm", {"eps": 1e-6}, [a, w], "numpy")[0], "fp32", "bound")
    src, dst = rand((4, 3), "fp16", 4), np.zeros((4, 3), np.float16)
    compile_steps([copy_step(view_of(dst), view_of(src))])({})
    np.testing.assert_array_equal(dst, src)


def test_bad_views_raise_before_any_c_call():
    x, w = rand((2, 16), "fp32", 1), rand((16,), "fp32", 2)
    y = np.zeros((2, 16), np.float32)
    cases = [
        (ShapeError, lambda: rms_norm_steps(view_of(x), view_of(w[:8]), None, 16, 1e-6, 0.0,
                                            view_of(y))),                       # short weight
        (ShapeError, lambda: rms_norm_steps(view_of(x[:, ::2]), None, None, 8, 1e-6, 0.0,
                                            view_of(y[:, :8]))),                # strided x
        (ShapeError, lambda: rms_norm_steps(view_of(x), view_of(w), None, 16, 1e-6, 0.0,
                                            view_of(y[:1]))),                   # short out
        (DtypeError, lambda: rms_norm_steps(view_of(x.astype(np.float64)), None, None, 16,
                                            1e-6, 0.0, view_of(y))),            # fp64
        (ShapeError, lambda: linear_steps(view_of(x), view_of(rand((4, 8))), None,
                                          view_of(np.empty((2, 4), np.float32)))),  # K
        (InputError, lambda: linear_steps(view_of(x), view_of(np.ones((4, 16), np.int8)), None,
                                          view_of(np.empty((2, 4), np.float32)))),  # no scale
        (ShapeError, lambda: activation_steps(view_of(x), "silu", view_of(y[:, :8]))),
        (InputError, lambda: activation_steps(view_of(x), "mish", view_of(y))),
        (ShapeError, lambda: softmax_steps(view_of(x), view_of(y.T))),
        (ShapeError, lambda: copy_step(view_of(y), view_of(x[:1]))),
    ]
    for exc, call in cases:
        with pytest.raises(exc) as ei:
            call()
        assert isinstance(ei.value, AtbError)
    assert not y.any()                                   # nothing was written


FFN = [({"activation_type": "swiglu"}, ["gate_w", "up_w", "down_w"]),
       ({"activation_type": "swiglu", "gate_up_merged": True}, ["gate_up_w", "down_w"]),
       ({"activation_type": "gelu", "bias": True, "has_residual": True},
        ["up_w", "down_w", "up_b", "down_b", "residual"])]


@pytest.mark.parametrize("dt", FLOATS)
def test_numpy_c_backend_against_the_reference(dt):
    be = get_backend("numpy_c")
    x, r, w, b = (rand((2, 3, 24), dt, 1), rand((2, 3, 24), dt, 2), rand((24,), dt, 3),
                  rand((24,), dt, 4))
    wl, s8 = rand((40, 24), dt, 5, 0.2), rand((40,), "fp32", 6, low=0.01, high=0.02)
    w8 = np.clip(np.round(rand((40, 24), "fp32", 7, 40.0)), -127, 127).astype(np.int8)
    calls = [("RmsNorm", {"weight_offset": 1.0}, [x, w]), ("AddRmsNorm", {}, [x, r, w]),
             ("LayerNorm", {}, [x, w, b]), ("LayerNorm", {}, [x]),
             ("AddLayerNorm", {}, [x, r, w, b]), ("Linear", {}, [x, wl, rand((40,), dt, 8)]),
             ("Linear", {"quant": "w8"}, [x, w8, None, s8]),
             ("RmsNormLinear", {"eps": 1e-5}, [x, w, wl, rand((40,), dt, 9)]), ("Gelu", {}, [x]),
             ("QuickGelu", {}, [x]), ("SiLU", {}, [x]), ("SwiGLU", {}, [x, r]),
             ("GeGLU", {"approximate": "tanh"}, [x]), ("Softmax", {}, [x])]
    shapes = {"gate_w": (40, 24), "up_w": (40, 24), "down_w": (24, 40), "gate_up_w": (80, 24),
              "up_b": (40,), "down_b": (24,), "residual": (2, 3, 24)}
    for params, names in FFN:
        ws = [rand(shapes[n], dt, 10 + i, 0.3) for i, n in enumerate(names)]
        calls.append(("FusedFeedForward", params, [x, *ws]))
    for op, params, ins in calls:
        ref = run(op, params, ins, "numpy")
        o = atb.Builder(backend="numpy_c").build_operation(op, params)
        got = o.execute(list(ins))
        assert o.last_backend == "numpy_c"
        assert be.kernel(op).impl.startswith("C kernel")
        for g, e in zip(got, ref):
            assert g.dtype == e.dtype and g.shape == e.shape, op
            assert_close(g, e, dt, f"{op} numpy_c vs numpy")


def test_numpy_c_falls_back_with_reason(caplog):
    import logging

    x, w = rand((4, 16), "fp32", 1), rand((16,), "fp32", 2)
    xs = rand((4, 32), "fp32", 3)[:, ::2]                               # not contiguous
    big, wl = rand((300, 16), "fp32", 4), rand((8, 16), "fp32", 5)
    with caplog.at_level(logging.DEBUG, logger="atb"):
        for op, ins in (("RmsNorm", [xs, w]), ("Linear", [big, wl])):
            y, = atb.Builder(backend="numpy_c").build_operation(op, {}).execute(ins)
            assert_close(y, run(op, {}, ins, "numpy")[0], "fp32", f"{op} fallback")
    assert "non-contiguous" in caplog.text and "300 rows" in caplog.text
    y, = atb.Builder(backend="numpy_c").build_operation("Softmax", {"dim": 0}).execute([x])
    assert_close(y, run("Softmax", {"dim": 0}, [x], "numpy")[0], "fp32", "softmax dim 0")


def test_numpy_c_graph_op_binds_the_c_calls():
    h, i = 32, 48
    g = atb.GraphOp([atb.LayerNorm(eps=1e-5), atb.Linear(out_features=i), atb.SiLU(),
                     atb.Linear(out_features=h), atb.ResidualAdd()], backend="numpy_c")
    g(rand((1, 2, h), "fp32", 0))
    ref = atb.GraphOp(g.graph, backend="numpy")          # the same graph and weights
    for seed in (1, 2, 3):
        x = rand((1, 2, h), "fp32", seed)
        assert_close(g(x), ref(x), "fp32", "bound GraphOp vs reference")
    plan = g.last_plan
    assert all(prog.bound for prog in plan.programs.values())
    assert all(all(p.bound.values()) for p in plan.programs.values())
    xs = rand((1, 2, 2 * h), "fp32", 4)[..., ::2]                      # strided input
    assert_close(g(xs), ref(np.ascontiguousarray(xs)), "fp32", "strided input")


ROPE = [({"num_heads": 4, "rotary_type": "half"}, [(2, 5, 64)], None),
        ({"num_heads": 4, "num_kv_heads": 2, "rotary_type": "interleave", "position_offset": 3},
         [(2, 5, 64), (2, 5, 32)], None),
        ({"head_dim": 16, "layout": "BNSD", "rotary_dim": 8}, [(2, 4, 5, 16), (2, 2, 5, 16)],
         [[0, 1, 2, 3, 9000], [5, 6, 7, 8, 9]]),             # past the first table: it grows
        ({"num_heads": 4}, [(1, 5, 64)], [1, 2, 3, 4, 5])]


@pytest.mark.parametrize("dt", FLOATS)
@pytest.mark.parametrize("params,shapes,pos", ROPE)
def test_numpy_c_rope_is_one_c_call(dt, params, shapes, pos):
    from atbcore.backends.cpu_kernels import bindings

    ins = [rand(s, dt, i) for i, s in enumerate(shapes)]
    if pos is not None:
        ins.append(np.asarray(pos, np.int64 if len(shapes) == 2 else np.int32))
    if len(shapes) == 1 and pos is not None:                 # given tables, indexed by ids
        ang = rand((10, 8), "fp32", 9)
        ins += [np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))]
    ref = run("RoPE", params, ins, "numpy")
    calls: list[str] = []
    bindings.SINKS.append(calls)
    try:
        got = atb.Builder(backend="numpy_c").build_operation("RoPE", params).execute(ins)
    finally:
        bindings.SINKS.remove(calls)
    assert calls.count("rope") >= 1 and set(calls) == {"rope"}, calls
    for g, e in zip(got, ref):
        assert_close(g, e, dt, f"RoPE {params}")


@pytest.mark.parametrize("dt", ["fp32", "bf16", "int8"])
def test_numpy_c_reshape_and_cache_writes_in_place(dt):
    from atbcore.backends.cpu_kernels import bindings

    kc = (rand((3, 4, 2, 8), "fp32", 1, 20.0)).astype(Dtype.of(dt).numpy)
    vc = (rand((3, 4, 2, 8), "fp32", 2, 20.0)).astype(Dtype.of(dt).numpy)
    k = (rand((4, 2, 8), "fp32", 3, 20.0)).astype(kc.dtype)
    v = (rand((4, 2, 8), "fp32", 4, 20.0)).astype(kc.dtype)
    ref_k, ref_v = kc.copy(), vc.copy()
    for slots in (np.array([3, -1, 11, 8], np.int64), np.array([0, 1, 2, 5], np.int32)):
        run("ReshapeAndCache", {}, [k, v, ref_k, ref_v, slots], "numpy")
        calls: list[str] = []
        bindings.SINKS.append(calls)
        try:
            op = atb.Builder(backend="numpy_c").build_operation("ReshapeAndCache")
            outs = op.execute([k, v, kc, vc, slots])
        finally:
            bindings.SINKS.remove(calls)
        assert calls == ["reshape_and_cache"] and outs[0] is kc and outs[1] is vc
        np.testing.assert_array_equal(kc.view(np.uint8), ref_k.view(np.uint8))
        np.testing.assert_array_equal(vc.view(np.uint8), ref_v.view(np.uint8))
    with pytest.raises(InputError, match="slot_mapping"):               # past the cache
        atb.Builder(backend="numpy_c").build_operation("ReshapeAndCache").execute(
            [k, v, kc, vc, np.array([0, 1, 2, 12], np.int64)])
    np.testing.assert_array_equal(kc.view(np.uint8), ref_k.view(np.uint8))  # untouched
