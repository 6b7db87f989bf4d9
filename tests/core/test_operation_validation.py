"""Operation.execute validates before it touches memory (issue 19): params are
type-checked at build, sizes bounded before allocation, empty inputs give empty
outputs, every output is checked (writable, device, shape, dtype) before any is
written, and kernel failures come back as AtbError naming the op."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import atbcore as atb
from atbcore.backends.torch import TORCH_KERNELS
from atbcore.errors import AtbError, DeviceError, InputError, ParamsError, ShapeError
from atbcore.ops.samples import sample_call


def build(op, params, backend="torch"):
    return atb.Builder(backend=backend).build_operation(op, params)


@pytest.mark.parametrize("op, params, fragment", [
    ("Argmax", {"keepdim": 0}, "keepdim"),
    ("RmsNorm", {"weight_offset": "x"}, "weight_offset"),
    ("RmsNorm", {"weight_offset": [1, "a"]}, "weight_offset"),
    ("Gather", {"axis": 1.5}, "axis"),
    ("Pad", {"pad_value": "x"}, "pad_value"),
    ("Transpose", {"perm": [1, "a"]}, "Transpose"),
    ("FlashAttention", {"head_dim": 0}, "head_dim"),
    ("FlashAttention", {"causal": 1}, "causal"),
    ("RoPE", {"max_seq_len": 2 ** 70}, "max_seq_len"),
])
def test_bad_param_types_fail_at_build(op, params, fragment):
    with pytest.raises(ParamsError) as ei:
        build(op, params)
    assert str(ei.value).startswith(f"{op}:") and fragment in str(ei.value)


def test_fused_op_errors_name_the_fused_op():
    with pytest.raises(ParamsError, match=r"^RopeFlashAttention: base"):
        build("RopeFlashAttention", {"num_heads": 2, "base": 0.5})
    with pytest.raises(ParamsError, match=r"^RopeFlashAttention: max_seq_len"):
        build("RopeFlashAttention", {"num_heads": 2, "max_seq_len": 0})


def test_huge_max_seq_len_is_bounded_before_allocation():
    params, ins = sample_call("RoPE")
    params["max_seq_len"] = 2 ** 40  # only the first table's size: clamped, still exact
    got = build("RoPE", params).execute([torch.from_numpy(x) for x in ins])
    ref = build("RoPE", params, "numpy").execute(ins)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-5, atol=1e-5)
    params, ins = sample_call("Pad")
    for backend in ("torch", "numpy"):
        with pytest.raises(ShapeError, match=r"^Pad: output size"):
            build("Pad", {**params, "max_seq_len": 2 ** 40}, backend).execute(ins)


@pytest.mark.parametrize("op", ["RmsNorm", "Gelu", "Softmax", "LayerNorm", "SwiGLU", "Linear",
                                "AddRmsNorm", "FlashAttention"])
def test_zero_rows_give_empty_outputs(op):
    params, ins = sample_call(op)
    ins[0] = ins[0][:0]
    if op == "AddRmsNorm":
        ins[1] = ins[1][:0]
    if op == "FlashAttention":
        ins[1], ins[2] = ins[1][:0], ins[2][:0]
    ref = build(op, params, "numpy").execute([x.copy() for x in ins])
    got = build(op, params).execute([torch.from_numpy(x.copy()) for x in ins])
    assert [tuple(g.shape) for g in got] == [r.shape for r in ref]
    assert all(g.numel() == 0 and g.dtype == torch.float32 for g in got)


@pytest.mark.parametrize("op", ["Gelu", "RmsNorm", "Softmax", "Linear", "RoPE", "Argmax"])
@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_zero_dim_inputs_raise_atb_errors(op, backend):
    params, ins = sample_call(op)
    ins[0] = np.array(ins[0].reshape(-1)[0])
    try:
        out = build(op, params, backend).execute(ins)
    except AtbError as e:
        assert str(e).startswith(f"{op}:")
    else:  # an elementwise op may take a scalar: then it must be right
        ref = build(op, params, "numpy").execute(ins)
        np.testing.assert_allclose(np.asarray(out[0], np.float64), ref[0], rtol=1e-6)


def _outputs(op, params, ins):
    return [np.zeros_like(r) for r in build(op, params, "numpy").execute([x.copy() for x in ins])]


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_read_only_output_is_refused_and_nothing_written(backend):
    params, ins = sample_call("AddRmsNorm")
    outs = _outputs("AddRmsNorm", params, ins)
    outs[1].flags.writeable = False
    with pytest.raises(InputError, match=r"^AddRmsNorm: output 'sum' is read-only"):
        build("AddRmsNorm", params, backend).execute(ins, outs)
    assert not outs[0].any() and not outs[1].any()


def test_meta_output_is_refused():
    params, ins = sample_call("RmsNorm")
    out = torch.empty(ins[0].shape, device="meta")
    with pytest.raises(DeviceError, match=r"^RmsNorm: output 'y' device"):
        build("RmsNorm", params).execute([torch.from_numpy(x) for x in ins], [out])


@pytest.mark.parametrize("op", ["AddRmsNorm", "AddLayerNorm", "RoPE", "Split", "Unpad"])
def test_multi_output_ops_write_nothing_when_a_later_output_is_bad(op):
    params, ins = sample_call(op)
    outs = [torch.from_numpy(o) for o in _outputs(op, params, ins)]
    outs[-1] = outs[-1][:1].expand(outs[-1].shape)  # one memory location, many elements
    with pytest.raises(InputError, match=rf"^{op}: output .* overlaps itself"):
        build(op, params).execute([torch.from_numpy(x) for x in ins], outs)
    assert all(not o.any() for o in outs[:-1])


def test_in_place_cache_ops_check_outputs_before_touching_the_caches():
    params, ins = sample_call("RopeKVCache")
    tins = [torch.from_numpy(x) for x in ins]
    q_out = np.zeros(ins[0].shape, np.float32)
    q_out.flags.writeable = False
    with pytest.raises(InputError, match=r"^RopeKVCache: output 'q_out' is read-only"):
        build("RopeKVCache", params).execute(tins, [q_out])
    assert not tins[3].any() and not tins[4].any()  # the caches were not written either


def test_kernel_runtime_error_becomes_atb_error(monkeypatch):
    import dataclasses

    def broken(p, ins):
        raise RuntimeError("C kernel rms_norm failed with status -1")

    build("RmsNorm", {})  # loads the torch kernels
    monkeypatch.setitem(TORCH_KERNELS, "RmsNorm",
                        dataclasses.replace(TORCH_KERNELS["RmsNorm"], fn=broken))
    params, ins = sample_call("RmsNorm")
    with pytest.raises(AtbError, match=r"^RmsNorm: torch kernel failed.*status -1") as ei:
        build("RmsNorm", params).execute([torch.from_numpy(x) for x in ins])
    assert isinstance(ei.value.__cause__, RuntimeError)


@pytest.mark.parametrize("backend", ["torch", "numpy"])
@pytest.mark.parametrize("op, cache", [("ReshapeAndCache", 3), ("RopeKVCache", 4)])
def test_read_only_cache_written_in_place_is_refused(backend, op, cache):
    params, ins = sample_call(op)
    ins[cache].flags.writeable = False  # a cache the op could only pretend to fill
    before = [np.array(x, copy=True) for x in ins]
    with pytest.raises(InputError, match=rf"^{op}: input '\w+' \(written in place\) is read-only"):
        build(op, params, backend).execute(ins)
    assert all(np.array_equal(a, b) for a, b in zip(ins, before))


def test_negative_stride_numpy_outputs_and_caches():
    params, ins = sample_call("RmsNorm")
    ref, = build("RmsNorm", params, "numpy").execute(ins)
    out = np.zeros(ref.shape[::-1], ref.dtype).T[::-1]  # negative strides, right shape
    build("RmsNorm", params).execute(ins, [out])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)  # the values arrived
    params, ins = sample_call("ReshapeAndCache")
    ins[2] = np.zeros(ins[2].shape[::-1], ins[2].dtype).T  # fine: torch can alias it
    ins[3] = np.ascontiguousarray(ins[3][::-1])[::-1]  # negative strides: torch would copy
    with pytest.raises(InputError, match=r"^ReshapeAndCache: input 'value_cache' .* negative"):
        build("ReshapeAndCache", params).execute(ins)
