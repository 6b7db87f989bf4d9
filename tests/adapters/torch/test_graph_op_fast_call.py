"""An ``atb_torch.GraphOp``'s guarded fast call (adapters/torch/atb_torch/graph_fast.py):
after one plain eager call, a call with the same input signature and the very same,
unmodified parameters runs the core's bound program directly. Checked: it is taken
(the general path is not entered), it equals the general path bit for bit and a NumPy
float64 reference, and every change that decides the result is seen by the next call
(a weight written in place, ``.data`` replaced, a parameter or layer replaced,
``load_state_dict``, a new shape or dtype, grad mode, a plugin, destroy). A user error
after it still raises an AtbError naming node, expected and given."""

import numpy as np
import pytest
import torch
from torch import nn

import atb_torch as atb
from atbcore.backends.cpu_kernels import available
from atbcore.runtime import native_run
from seed_mlp import HIDDEN, INTER, NAMES, mlp_reference, seed_mlp

pytestmark = pytest.mark.skipif(not available(), reason="the C kernels are not built here")

def _mlp(seed=0):
    return seed_mlp(seed)[0]


def _weights(mlp):
    """The module's current parameters, by reference name, in float64."""
    return {next(v for k, v in NAMES.items() if name.endswith(k)): p.detach().double().numpy()
            for name, p in mlp.named_parameters()}


_reference = mlp_reference


def _close(y, ref):
    np.testing.assert_allclose(y.double().numpy(), ref, rtol=1e-4, atol=1e-4)


def _x(rows, seed=1):
    return torch.randn(1, rows, HIDDEN, generator=torch.Generator().manual_seed(seed))


class _Refuse:
    """Makes the general path fail loudly: a call that enters it was not fast."""

    def __init__(self, mlp, monkeypatch):
        monkeypatch.setattr(mlp._runner, "ready", self)

    def __call__(self, *a, **k):
        raise AssertionError("the general path ran")


@pytest.mark.parametrize("rows", [1, 5])
def test_fast_call_taken_and_bit_equal_to_general_path(rows, monkeypatch):
    mlp = _mlp()
    xs = [_x(rows, s) for s in range(4)]
    with torch.no_grad():
        general = []
        for x in xs:
            mlp._fast = None  # each call through the general path
            general.append(mlp(x))
        assert mlp._fast is not None
        fast_call = mlp._fast
        refuse = _Refuse(mlp, monkeypatch)
        fast = [mlp(x) for x in xs]
        monkeypatch.undo()
        del refuse
    assert mlp._fast is fast_call
    was, native_run.NATIVE[0] = native_run.NATIVE[0], False  # calls one by one, in Python
    try:
        with torch.no_grad():
            per_call = [mlp(x) for x in xs]
    finally:
        native_run.NATIVE[0] = was
    w = _weights(mlp)
    for g, f, c, x in zip(general, fast, per_call, xs):
        assert torch.equal(g, f) and torch.equal(f, c)
        _close(f, _reference(x, w))
    # earlier outputs are fresh tensors, not overwritten by later calls
    assert not any(a.data_ptr() == b.data_ptr() for a, b in zip(fast, fast[1:]))


def test_weight_written_in_place_is_seen_by_next_call():
    mlp = _mlp()
    x = _x(3)
    with torch.no_grad():
        mlp(x)
        mlp(x)
        assert mlp._fast is not None
        mlp.layers["linear"].weight.mul_(0.5)       # in place: version bump
        y1 = mlp(x)
        _close(y1, _reference(x, _weights(mlp)))
        mlp.layers["linear_1"].bias.add_(1.0)
        y2 = mlp(x)
        _close(y2, _reference(x, _weights(mlp)))
        assert not torch.equal(y1, y2)
        mlp(x)
        assert mlp._fast is not None  # the fast call came back after the changes


def test_data_replaced_parameter_replaced_and_load_state_dict_are_seen():
    mlp, other = _mlp(0), _mlp(7)
    x = _x(2)
    with torch.no_grad():
        mlp(x)
        mlp(x)
        p = mlp.layers["linear"].weight
        p.data = p.data * 2.0                         # new storage, same object
        _close(mlp(x), _reference(x, _weights(mlp)))
        mlp.layers["linear"].weight = nn.Parameter(torch.randn(INTER, HIDDEN) * 0.1)
        _close(mlp(x), _reference(x, _weights(mlp)))
        mlp.load_state_dict(other.state_dict())
        y = mlp(x)
        _close(y, _reference(x, _weights(other)))
        assert torch.equal(y, other(x))
        mlp.layers["linear_1"] = atb.Linear(out_features=HIDDEN)  # a new layer
        with torch.no_grad():
            mlp(x)  # materialises its weights
            mlp.layers["linear_1"].weight.copy_(other.layers["linear_1"].weight)
            mlp.layers["linear_1"].bias.copy_(other.layers["linear_1"].bias)
        assert torch.equal(mlp(x), y)


def test_new_shape_dtype_and_noncontiguous_inputs_take_the_general_path():
    mlp = _mlp()
    with torch.no_grad():
        mlp(_x(1))
        mlp(_x(1))
        x4 = _x(4)
        _close(mlp(x4), _reference(x4, _weights(mlp)))
        xt = torch.randn(HIDDEN, 1, 3).permute(1, 2, 0)   # not contiguous, same shape
        assert not xt.is_contiguous()
        _close(mlp(xt), _reference(xt.contiguous(), _weights(mlp)))
        xb = _x(4).bfloat16()
        yb = mlp(xb)
        assert yb.dtype == torch.bfloat16
        np.testing.assert_allclose(yb.double().numpy(), _reference(xb.float(), _weights(mlp)),
                                   rtol=4e-2, atol=4e-2)
        _close(mlp(x4), _reference(x4, _weights(mlp)))  # back to float32


def test_user_error_after_fast_calls_raises_and_next_call_is_right():
    mlp = _mlp()
    x = _x(2)
    with torch.no_grad():
        good = mlp(x)
        mlp(x)
        with pytest.raises(atb.AtbError) as e:
            mlp(torch.randn(1, 2, HIDDEN + 1))
        msg = str(e.value)
        assert "expected" in msg and "given" in msg and str(HIDDEN + 1) in msg
        assert torch.equal(mlp(x), good)
        out = torch.full((1, 2, HIDDEN), 7.0)
        with pytest.raises(atb.AtbError):
            mlp.execute([torch.randn(1, 2, HIDDEN + 1)], [out])
        assert bool((out == 7.0).all())  # nothing written by the failed call


def test_grad_mode_plugin_and_destroy_are_seen():
    mlp = _mlp()
    x = _x(2)
    with torch.no_grad():
        y = mlp(x)
        mlp(x)
    out = mlp(x)  # grad mode, parameters require grad: the custom op, refusing backward
    assert torch.equal(out.detach(), y) and out.requires_grad
    with pytest.raises(atb.AtbError, match="inference-only"):
        out.sum().backward()

    class Twice(atb.Plugin):
        def postprocess(self, outputs):
            return [o * 2 for o in outputs]

    with torch.no_grad():
        mlp(x)
        mlp.register_plugin("post_block", Twice())
        torch.testing.assert_close(mlp(x), 2 * y)
        mlp.destroy()
        with pytest.raises(atb.AtbError, match="destroyed"):
            mlp(x)


def test_output_aliasing_an_input_is_cloned():
    g = atb.GraphOp([atb.Reshape(shape=[1, -1])])
    x = torch.arange(6.0).reshape(2, 3)
    with torch.no_grad():
        for _ in range(3):
            y = g(x)
            assert torch.equal(y, x.reshape(1, -1))
            assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
