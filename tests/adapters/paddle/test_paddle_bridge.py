"""Paddle tensors in the core: DLPack zero-copy both ways (checked by writing through
one view and reading the other), bf16 bit views, devices, the plugin entry point,
and native-first dispatch of Paddle tensors to the Paddle backend."""

import numpy as np
import pytest

paddle = pytest.importorskip("paddle", reason="paddlepaddle is not installed")

import atbcore as atb  # noqa: E402
from atbcore.backends import get_backend  # noqa: E402
from atbcore.ops.registry import get_op  # noqa: E402
from atbcore.tensor import convert, describe, from_numpy, to_numpy  # noqa: E402
from oracle import rand  # noqa: E402
from paddle_cases import to_paddle  # noqa: E402  (registers the backend)

from atb_paddle.bridge import PaddleBridge, device_of_place  # noqa: E402


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16", "int8", "int64"])
def test_paddle_numpy_views_share_memory(dtype):
    t = paddle.to_tensor(np.arange(12, dtype=np.float32).reshape(3, 4)).astype(
        atb.Dtype.of(dtype).value)
    a = to_numpy(t)                                   # paddle -> numpy: a view
    assert a.dtype == atb.Dtype.of(dtype).numpy and a.shape == (3, 4)
    a[1, 2] = 7
    assert float(t[1, 2].astype("float32")) == 7.0    # written through numpy, read in paddle
    b = rand((2, 5), dtype, 3) if dtype in ("fp32", "fp16", "bf16") else np.ones((2, 5), a.dtype)
    p = from_numpy(b, "paddle")                       # numpy -> paddle: a view
    assert describe(p).dtype == atb.Dtype.of(dtype)
    p[0, 1] = 3
    assert float(b[0, 1]) == 3.0                      # written in paddle, read through numpy


def test_copies_where_paddle_cannot_alias():
    ro = np.arange(4, dtype=np.float32)
    ro.flags.writeable = False
    p = from_numpy(ro, "paddle")
    p[0] = 9.0
    assert ro[0] == 0.0                               # Paddle got its own copy
    rev = np.arange(4, dtype=np.float32)[::-1]        # negative strides crash Paddle's import
    np.testing.assert_array_equal(from_numpy(rev, "paddle").numpy(), rev)
    nc = np.arange(8, dtype=np.float32).reshape(2, 4).T
    np.testing.assert_array_equal(from_numpy(nc, "paddle").numpy(), nc)


def test_paddle_torch_views_share_memory():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    t = paddle.zeros([2, 3], dtype="bfloat16")
    tt = convert(t, "torch")
    assert tt.dtype == torch.bfloat16
    tt[0, 0] = 2.5
    assert float(t[0, 0].astype("float32")) == 2.5
    src = torch.zeros(4)
    back = convert(src, "paddle")
    back[1] = 4.0
    assert float(src[1]) == 4.0


def test_descriptors_and_device_names():
    d = describe(paddle.ones([2, 3], dtype="float16"))
    assert d == atb.TensorDesc([2, 3], atb.Dtype.FP16)
    assert device_of_place(paddle.CPUPlace()) == "cpu"
    assert device_of_place("Place(gpu:1)") == "cuda:1"
    assert device_of_place("Place(npu:0)") == "npu:0"
    assert isinstance(atb.tensor._BRIDGES["paddle"], PaddleBridge)


def test_paddle_backend_is_native_first_and_refuses_missing_devices():
    op = atb.Builder().build_operation("RmsNorm", {"eps": 1e-6})
    x, w = rand((2, 8), "fp32", 1), rand((8,), "fp32", 2)
    y, = op.execute([to_paddle(x), to_paddle(w)])
    assert op.last_backend == "paddle" and isinstance(y, paddle.Tensor)
    op.execute([x, w])                                 # NumPy callers are not moved to Paddle
    assert op.last_backend != "paddle"
    be = get_backend("paddle")
    assert be.native == "paddle" and be.native_first and be.priority == 30
    opdef = get_op("RmsNorm")
    descs = {"x": atb.TensorDesc([2, 8], device="cuda:0"), "weight": atb.TensorDesc([8], device="cuda:0")}
    if "cuda:0" not in be.devices():
        reasons = be.not_supported_reasons(opdef, opdef.make_params({}), descs)
        assert reasons and "cuda:0" in reasons[0] and "does not have" in reasons[0]


def test_plugin_entry_point_registers_backend_and_bridge(monkeypatch):
    """What the entry point does, on a private manager (the process-wide one has
    already loaded it through the installed entry point)."""
    from atbcore.backends import _BACKENDS
    from atbcore.plugin.manager import AtbPluginManager

    import atb_paddle.plugin as plug

    monkeypatch.delitem(_BACKENDS, "paddle")
    pm = AtbPluginManager()
    pm.register(plug, name="atb_paddle_test")
    assert get_backend("paddle").name == "paddle"
    assert "atb_register_backends" in pm.hooks_of(plug)


def test_atb_paddle_is_loaded_through_the_installed_entry_point():
    from atbcore.plugin import get_plugin_manager

    assert get_plugin_manager().records["atb_paddle"].status == "loaded"


def test_importing_atb_paddle_imports_no_paddle():
    import subprocess
    import sys

    code = ("import sys, atb_paddle, atbcore; from atbcore.backends import get_backend; "
            "get_backend('paddle'); assert 'paddle' not in sys.modules, 'paddle imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


_NO_TORCH = r'''
import sys, importlib.abc

class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}")

sys.meta_path.insert(0, _NoTorch())                       # as if torch were not installed
import numpy as np
import atbcore.backends.torch as tb
tb.TorchBackend.unavailable_reason = lambda self: "torch is not installed"
import atb_paddle as atb
import paddle
x = paddle.randn([2, 5, 32])
mlp = atb.GraphOp([atb.LayerNorm(eps=1e-5), atb.Linear(out_features=64), atb.SiLU(),
                   atb.Linear(out_features=32), atb.ResidualAdd()])
y = mlp(x)
assert isinstance(y, paddle.Tensor), type(y)
assert {c.backend for c in mlp.core.last_plan.calls} == {"paddle"}
op = atb.Builder().build_operation("RmsNorm")
y2, = op.execute([x.numpy(), np.ones(32, np.float32)])
assert op.last_backend == "paddle" and isinstance(y2, np.ndarray)
assert "torch" not in sys.modules
print("ok")
'''


def test_paddle_user_without_torch():
    """With torch missing, Paddle tensors (and NumPy ones) run on the Paddle backend,
    through the torch-free bridge."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _NO_TORCH], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
