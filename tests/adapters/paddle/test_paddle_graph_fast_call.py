"""An ``atb_paddle.GraphOp``'s guarded fast call (atb_paddle/layers/fast_call.py): after
one plain call, a call with the same input signature and unchanged parameters runs the
core's remembered program directly. Checked: it is taken, it equals the general path
bit for bit and a NumPy float64 reference, and every change that decides the result
is seen by the next call (an in-place write, ``set_value``, ``set_state_dict``, a
replaced parameter, a new shape, a plugin); a user error still raises an AtbError
naming node, expected and given."""

import numpy as np
import paddle
import pytest

import atb_paddle as atb
from atbcore.backends.cpu_kernels import available

pytestmark = pytest.mark.skipif(not available(), reason="the C kernels are not built here")

HIDDEN, INTER = 40, 72  # odd sizes: panel tails in both matmuls


def _mlp(seed=0):
    mlp = atb.GraphOp([atb.LayerNorm(eps=1e-5), atb.Linear(out_features=INTER), atb.SiLU(),
                       atb.Linear(out_features=HIDDEN), atb.ResidualAdd()])
    mlp(paddle.zeros([1, 1, HIDDEN]))
    rng = np.random.default_rng(seed)
    for name, p in mlp.named_parameters():
        scale = 1.0 if name == "0.weight" else 0.1
        base = 1.0 if name == "0.weight" else 0.0
        p.set_value((base + scale * rng.standard_normal(p.shape)).astype(np.float32))
    return mlp


def _reference(x, mlp):
    """The MLP in NumPy float64 from the layer's current parameters."""
    w = {k: v.numpy().astype(np.float64) for k, v in mlp.state_dict().items()}

    def linear(h, wt, b):  # Paddle keeps a Linear weight as [in, out]
        return h @ (wt if wt.shape[0] == h.shape[-1] else wt.T) + b

    x = x.numpy().astype(np.float64)
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    h = (x - mu) / np.sqrt(var + 1e-5) * w["0.weight"] + w["0.bias"]
    u = linear(h, w["1.weight"], w["1.bias"])
    return linear(u / (1 + np.exp(-u)), w["3.weight"], w["3.bias"]) + x


def _close(y, x, mlp):
    np.testing.assert_allclose(y.numpy().astype(np.float64), _reference(x, mlp),
                               rtol=1e-4, atol=1e-4)


def _x(rows, seed=1):
    return paddle.to_tensor(np.random.default_rng(seed).standard_normal(
        (1, rows, HIDDEN)).astype(np.float32))


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

    monkeypatch.setattr(mlp._block, "get", refuse)
    fast = [mlp(x) for x in xs]
    monkeypatch.undo()
    for g, f, x in zip(general, fast, xs):
        np.testing.assert_array_equal(g.numpy(), f.numpy())
        _close(f, x, mlp)
    assert len({f.data_ptr() for f in fast}) == len(fast)  # fresh outputs


def test_weight_changes_are_seen_by_next_call():
    mlp, other = _mlp(0), _mlp(5)
    x = _x(3)
    mlp(x)
    mlp(x)
    assert mlp._fast is not None
    w1 = dict(mlp.named_parameters())["1.weight"]
    with paddle.no_grad():
        w1.scale_(0.5)                                   # in place: inplace version
    _close(mlp(x), x, mlp)
    b2 = dict(mlp.named_parameters())["3.bias"]
    b2.set_value(b2.numpy() + 1.0)                       # set_value: same memory
    _close(mlp(x), x, mlp)
    mlp.set_state_dict(other.state_dict())
    y = mlp(x)
    np.testing.assert_array_equal(y.numpy(), other(x).numpy())
    _close(y, x, mlp)
    mlp(x)
    assert mlp._fast is not None


def test_new_shape_plugin_and_errors():
    mlp = _mlp()
    x1, x4 = _x(1), _x(4)
    y1 = mlp(x1)
    mlp(x1)
    _close(mlp(x4), x4, mlp)
    with pytest.raises(atb.AtbError) as e:
        mlp(paddle.zeros([1, 2, HIDDEN + 1]))
    assert "expected" in str(e.value) and str(HIDDEN + 1) in str(e.value)
    np.testing.assert_array_equal(mlp(x1).numpy(), y1.numpy())

    class Twice(atb.Plugin):
        def postprocess(self, outputs):
            return [o * 2 for o in outputs]

    mlp.register_plugin("post_block", Twice())
    np.testing.assert_allclose(mlp(x1).numpy(), 2 * y1.numpy(), rtol=1e-6)
