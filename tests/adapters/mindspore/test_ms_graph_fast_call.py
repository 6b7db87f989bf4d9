"""An ``atb_mindspore.GraphOp``'s guarded fast call in PyNative (cells/fast_call.py):
after one plain call, a call with the same input signature and unchanged Parameters
runs the core's remembered program directly. Checked: it is taken, it equals the
general path bit for bit and a NumPy float64 reference, and every change that decides
the result is seen by the next call (``set_data``, in-place writes with
``refresh_weights``, a new shape, a plugin, a forward hook); a user error
still raises an AtbError naming node, expected and given."""

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="mindspore is not installed")

import atb_mindspore as atb  # noqa: E402
from atbcore.backends.cpu_kernels import available  # noqa: E402

pytestmark = pytest.mark.skipif(not available(), reason="the C kernels are not built here")

HIDDEN, INTER = 40, 72  # odd sizes: panel tails in both matmuls


def _params(mlp):
    """The GraphOp's Parameters by layer position and kind (``"1.weight"``)."""
    return {".".join(p.name.split(".")[-2:]): p for p in mlp.get_parameters()}


def _mlp(seed=0):
    mlp = atb.GraphOp([atb.LayerNorm(eps=1e-5), atb.Linear(out_features=INTER), atb.SiLU(),
                       atb.Linear(out_features=HIDDEN), atb.ResidualAdd()])
    mlp(ms.Tensor(np.zeros((1, 1, HIDDEN), np.float32)))
    rng = np.random.default_rng(seed)
    for name, p in _params(mlp).items():
        base, scale = (1.0, 0.1) if name == "0.weight" else (0.0, 0.1)
        p.set_data(ms.Tensor((base + scale * rng.standard_normal(p.shape)).astype(np.float32)))
    return mlp


def _reference(x, mlp):
    w = {k: p.asnumpy().astype(np.float64) for k, p in _params(mlp).items()}

    def linear(h, wt, b):
        return h @ (wt if wt.shape[0] == h.shape[-1] else wt.T) + b

    x = x.asnumpy().astype(np.float64)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    h = (x - mu) / np.sqrt(var + 1e-5) * w["0.weight"] + w["0.bias"]
    u = linear(h, w["1.weight"], w["1.bias"])
    return linear(u / (1 + np.exp(-u)), w["3.weight"], w["3.bias"]) + x


def _close(y, x, mlp):
    np.testing.assert_allclose(y.asnumpy().astype(np.float64), _reference(x, mlp),
                               rtol=1e-4, atol=1e-4)


def _x(rows, seed=1):
    return ms.Tensor(np.random.default_rng(seed).standard_normal((1, rows, HIDDEN))
                     .astype(np.float32))


@pytest.mark.parametrize("rows", [1, 5])
def test_fast_call_taken_and_bit_equal_to_general_path(rows, monkeypatch):
    mlp = _mlp()
    xs = [_x(rows, s) for s in range(4)]
    general = []
    for x in xs:
        mlp._fast = None
        general.append(mlp(x))
    assert mlp._fast is not None

    def refuse(*a, **k):
        raise AssertionError("the general path ran")

    monkeypatch.setattr(mlp._block, "ensure", refuse)
    fast = [mlp(x) for x in xs]
    monkeypatch.undo()
    for g, f, x in zip(general, fast, xs):
        np.testing.assert_array_equal(g.asnumpy(), f.asnumpy())
        _close(f, x, mlp)


def test_weight_changes_are_seen_by_next_call():
    mlp = _mlp()
    x = _x(3)
    y0 = mlp(x)
    mlp(x)
    assert mlp._fast is not None
    b2 = _params(mlp)["3.bias"]
    b2.set_data(ms.Tensor(b2.asnumpy() + 1.0))         # new memory: seen by itself
    y1 = mlp(x)
    _close(y1, x, mlp)
    assert not np.allclose(y0.asnumpy(), y1.asnumpy())
    w1 = _params(mlp)["1.weight"]
    ms.ops.assign(w1, w1 * 0.5)                       # in place (MindSpore may not bump
    mlp.refresh_weights()                             # its version): said explicitly
    y2 = mlp(x)
    _close(y2, x, mlp)
    assert not np.allclose(y1.asnumpy(), y2.asnumpy())
    w2 = _params(mlp)["3.weight"]
    w2[0] = 0.0                                       # an item write, likewise
    mlp.refresh_weights()
    _close(mlp(x), x, mlp)
    mlp(x)
    assert mlp._fast is not None


def test_new_shape_hooks_plugin_and_errors():
    mlp = _mlp()
    x1, x4 = _x(1), _x(4)
    y1 = mlp(x1)
    mlp(x1)
    _close(mlp(x4), x4, mlp)
    with pytest.raises(atb.AtbError) as e:
        mlp(ms.Tensor(np.zeros((1, 2, HIDDEN + 1), np.float32)))
    assert "expected" in str(e.value) and str(HIDDEN + 1) in str(e.value)
    np.testing.assert_array_equal(mlp(x1).asnumpy(), y1.asnumpy())

    seen = []
    handle = mlp.register_forward_hook(lambda cell, inputs, output: seen.append(1))
    mlp(x1)
    assert seen == [1]                                 # the Cell machinery ran the hook
    handle.remove()

    class Twice(atb.Plugin):
        def postprocess(self, outputs):
            return [o * 2 for o in outputs]

    mlp.register_plugin("post_block", Twice())
    np.testing.assert_allclose(mlp(x1).asnumpy(), 2 * y1.asnumpy(), rtol=1e-6)
