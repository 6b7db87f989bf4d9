"""Bound C calls (arguments packed once for a plan that reuses its buffers) give the
same bits as the unbound calls, read what the caller wrote since binding, and check
what changes per call; oracles: the unbound C calls, torch.nn.functional, SDPA."""

import pytest
import torch
import torch.nn.functional as F

from atbcore.backends.cpu_kernels import available
from atbcore.errors import InputError, ShapeError
from atbcore.numerics import assert_close

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler here: C kernels absent")


@pytest.mark.parametrize("bias", [False, True])
def test_linear_rows_bound_io_packs_the_addresses_of_each_call(bias):
    from atbcore.backends.cpu_kernels.torch_linear import linear_rows, linear_rows_bound_io

    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    like_x, like_y = torch.empty(3, 40), torch.empty(3, 96)
    io = linear_rows_bound_io(like_x, w, like_y, bias=b)
    for seed in (2, 3):  # fresh input and output tensors per call, as a plan's slots are
        x = torch.randn(3, 40, generator=torch.Generator().manual_seed(seed))
        y = torch.empty(3, 96)
        io(x, y)
        assert torch.equal(y, linear_rows(x, w, bias=b))
        assert_close(y, F.linear(x, w, b), "fp32", "bound linear vs F.linear")
    with pytest.raises(ShapeError, match="out"):
        io(torch.randn(3, 40), torch.empty(3, 95))
    with pytest.raises(ShapeError, match="x"):
        io(torch.randn(3, 40).t().contiguous().t(), torch.empty(3, 96))  # strided x


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
def test_norm_bound_equals_the_unbound_kernel_for_contiguous_and_strided_x(name):
    from atbcore.backends.cpu_kernels import torch_ops as ck

    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(48, generator=g), torch.randn(48, generator=g)
    bias = b if name == "layer_norm" else None
    out = torch.empty(5, 48)
    call = ck.norm_bound(name, w, bias, 48, 1e-5, 0.0, out)
    wide = torch.randn(5, 96, generator=g)
    for x in (torch.randn(5, 48, generator=g), wide[:, :48]):  # the second one strided
        call(x)
        if name == "layer_norm":
            want, _ = ck.layer_norm(x, w, b, 48, 1e-5)
            ref = F.layer_norm(x, [48], w, b, 1e-5)
        else:
            want, _ = ck.rms_norm(x, w, 48, 1e-5)
            ref = F.rms_norm(x, [48], w, 1e-5)
        assert torch.equal(out, want)
        assert_close(out, ref, "fp32", f"bound {name} vs torch")
    rows_apart = torch.zeros(5, 96)  # rows of unit stride, 96 apart: written in place
    ck.norm_bound(name, w, bias, 48, 1e-5, 0.0, rows_apart[:, :48])(wide[:, :48])
    assert torch.equal(rows_apart[:, :48], out) and not rows_apart[:, 48:].any()
    with pytest.raises(ShapeError, match="out"):  # columns apart: no row view
        ck.norm_bound(name, w, bias, 48, 1e-5, 0.0, torch.empty(48, 5).t())


def test_paged_decode_attention_bound_reads_lengths_written_after_binding():
    from atbcore.backends.cpu_kernels.torch_decode import (paged_decode_attention,
                                                           paged_decode_attention_bound)

    g = torch.Generator().manual_seed(5)
    kc, vc = torch.randn(6, 8, 2, 16, generator=g), torch.randn(6, 8, 2, 16, generator=g)
    q = torch.randn(2, 4, 16, generator=g)
    tables = torch.tensor([[0], [3]], dtype=torch.int32)
    lens = torch.tensor([3, 5], dtype=torch.int32)
    out = torch.empty(2, 4, 16)
    call = paged_decode_attention_bound(q, kc, vc, tables, lens, scale=0.25, out=out)
    for n in (0, 2):
        lens += n  # the next decode step, written in place
        call()
        assert torch.equal(out, paged_decode_attention(q, kc, vc, tables, lens, scale=0.25))
    lens[1] = 9  # past the tables' reach (one block of 8): refused, checked per call
    with pytest.raises(ShapeError, match="context_lens"):
        call()
    lens[1] = 5
    tables[1, 0] = 6  # a block id past the cache: refused before the kernel reads it
    with pytest.raises(InputError, match="block_tables"):
        call()


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
def test_add_norm_bound_writes_the_sum_and_its_norm(name):
    from atbcore.backends.cpu_kernels import torch_ops as ck

    g = torch.Generator().manual_seed(6)
    x, r = torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g)
    w, b = torch.randn(32, generator=g), torch.randn(32, generator=g)
    bias = b if name == "layer_norm" else None
    y, s = torch.empty(4, 32), torch.empty(4, 32)
    ck.norm_bound(name, w, bias, 32, 1e-5, 0.0, y, s)(x, r)
    fn = ck.layer_norm if name == "layer_norm" else ck.rms_norm
    args = (x, w, b, 32, 1e-5) if name == "layer_norm" else (x, w, 32, 1e-5)
    want_y, want_s = fn(*args, residual=r)
    assert torch.equal(s, want_s) and torch.equal(y, want_y)
    assert_close(s, x + r, "fp32", "bound add-norm sum")
    with pytest.raises(ShapeError, match="sum_out"):
        ck.norm_bound(name, w, bias, 32, 1e-5, 0.0, y, torch.empty(4, 32, dtype=torch.bfloat16))
