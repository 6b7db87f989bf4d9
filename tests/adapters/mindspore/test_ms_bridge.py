"""Where MindSpore tensors cross without copies (checked by writing through the
other side's view) and where they are copied, as the package docs state."""

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="mindspore is not installed")

import atb_mindspore  # noqa: E402,F401
from atbcore.dtypes import Dtype  # noqa: E402
from atbcore.tensor import convert, describe, from_numpy, is_tensor, to_numpy  # noqa: E402
from oracle import rand  # noqa: E402


def test_numpy_to_mindspore_shares_memory_bf16_included():
    for dt in ("fp32", "fp16", "bf16"):
        a = rand([2, 3], dt, 1)
        t = from_numpy(a, "mindspore")
        a[0, 0] = 5
        assert float(t.astype(ms.float32).asnumpy()[0, 0]) == 5.0, dt
        assert describe(t).dtype == Dtype.of(dt)


def test_copies_where_documented():
    a = rand([3, 4], "fp32", 1)
    t = from_numpy(a.T, "mindspore")             # non-contiguous array: copied
    a[0, 0] = 9
    assert t.asnumpy()[0, 0] != 9
    ro = rand([3], "fp32", 2)
    ro.flags.writeable = False
    t2 = from_numpy(ro, "mindspore")             # read-only array: copied, never aliased
    assert t2.data_ptr() != ro.ctypes.data
    nc = ms.mint.transpose(ms.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3)), 0, 1)
    n = to_numpy(nc)                             # a transposed view comes back contiguous
    assert n.flags.c_contiguous and n[0, 1] == 3


def test_mindspore_to_numpy_shares_memory():
    t = ms.Tensor(np.zeros((2, 3), np.float32))
    to_numpy(t)[1, 2] = 4
    assert t.asnumpy()[1, 2] == 4
    b = ms.Tensor(np.ones((2, 3), np.float32)).astype(ms.bfloat16)
    v = to_numpy(b)                               # bf16: a read-only zero-copy view
    assert v.dtype == Dtype.BF16.numpy and not v.flags.writeable
    assert v.ctypes.data == b.data_ptr()


def test_parameters_are_mindspore_tensors_and_cross_to_torch_without_copy():
    torch = pytest.importorskip("torch")
    p = ms.Parameter(ms.Tensor(np.ones((2, 2), np.float32)), name="w")
    assert is_tensor(p) and describe(p).shape == (2, 2)
    tt = convert(p, "torch")
    tt[0, 0] = 3
    assert p.asnumpy()[0, 0] == 3
    back = convert(torch.arange(6.0).reshape(2, 3).t(), "mindspore")   # strides kept
    assert back.shape == (3, 2) and back.asnumpy()[0, 1] == 3
    x = torch.zeros(4)
    m = convert(x, "mindspore")
    x[1] = 7
    assert m.asnumpy()[1] == 7


def test_kernels_see_mindspore_tensors_as_they_are():
    """On the MindSpore backend, a MindSpore input reaches the kernel itself."""
    import atbcore as atb
    from atb_mindspore.backend import MS_KERNELS, register

    register().load()
    seen = []
    k = MS_KERNELS["ResidualAdd"]
    orig = k.fn
    object.__setattr__(k, "fn", lambda p, ins: (seen.append(ins["x"]), orig(p, ins))[1])
    try:
        x = ms.Tensor(np.ones((2, 2), np.float32))
        atb.Builder().build_operation("ResidualAdd").execute([x, x])
    finally:
        object.__setattr__(k, "fn", orig)
    assert seen and seen[0] is x


def test_plugin_module_registers_backend_and_bridge(monkeypatch):
    """What the ``atb`` entry point ``atb_mindspore = "atb_plugins.mindspore_adapter"``
    does (MindSpore loaded), on a private plugin manager."""
    import atbcore.tensor as core_tensor
    from atbcore.backends import _BACKENDS, get_backend
    from atbcore.plugin.manager import AtbPluginManager

    import atb_mindspore.bridge as bridge
    import atb_plugins.mindspore_adapter as plug

    monkeypatch.delitem(_BACKENDS, "mindspore")
    monkeypatch.setitem(core_tensor._BRIDGES, "mindspore", core_tensor._MindSporeBridge())
    monkeypatch.setattr(bridge, "_INSTALLED", False)
    p = ms.Parameter(ms.Tensor(np.ones(2, np.float32)), name="p")
    assert is_tensor(p)                           # the core's bridge knows Parameters too
    pm = AtbPluginManager()
    pm.register(plug, name="atb_mindspore_test")
    assert get_backend("mindspore").native_first
    assert is_tensor(p) and isinstance(core_tensor._BRIDGES["mindspore"], bridge.MindSporeBridge)
