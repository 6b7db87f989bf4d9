"""The C-kernel wrappers at the edges their checks opened up: zero rows give empty
outputs (as torch does), a window past every key is causal attention, padded
block tables are read only as far as each row's length, and a table changed in
place is checked again."""

import pytest
import torch
import torch.nn.functional as F

from atbcore.backends.cpu_kernels import available
from atbcore.backends.cpu_kernels import torch_decode as cd
from atbcore.backends.cpu_kernels import torch_ops as co
from atbcore.backends.cpu_kernels import torch_prefill as cp
from atbcore.errors import InputError, ShapeError

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler here: C kernels absent")


def test_zero_rows_give_empty_outputs_like_torch():
    x = torch.randn(0, 64)
    y, s = co.rms_norm(x, torch.ones(64), 64, 1e-6, residual=torch.randn(0, 64))
    assert y.shape == (0, 64) and s.shape == (0, 64)
    y, _ = co.layer_norm(x, torch.ones(64), torch.zeros(64), 64, 1e-5)
    assert y.shape == F.layer_norm(x, (64,)).shape
    assert co.activation(torch.randn(0, 128), "silu", split=True).shape == (0, 64)
    assert co.softmax(torch.randn(3, 0, 8)).shape == (3, 0, 8)
    w = torch.randn(32, 64)
    y = cd.linear_rows(x, w, bias=torch.randn(32))
    assert y.shape == (x @ w.T).shape == (0, 32)
    assert cd.argmax_rows(torch.randn(0, 50)).shape == torch.argmax(torch.randn(0, 50), -1).shape
    k = torch.randn(0, 2, 16)
    out = cp.prefill_attention(torch.randn(0, 4, 16), k, k, scale=0.25, q_lens=[])
    assert out.shape == (0, 4, 16)
    kc = torch.randn(4, 8, 2, 16)
    out = cd.paged_decode_attention(torch.randn(0, 4, 16), kc, kc, torch.zeros(0, 2,
                                    dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                                    scale=0.25)
    assert out.shape == (0, 4, 16)
    assert cd.reshape_and_cache(torch.randn(0, 2, 16), torch.randn(0, 2, 16), kc, kc.clone(),
                                torch.zeros(0, dtype=torch.int64))


def test_a_window_past_every_key_is_causal_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 12, 2, 16, generator=g) for _ in range(3))
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), is_causal=True).transpose(1, 2)
    for window in (12, 2 ** 31, 2 ** 32 + 1):  # 2**32 + 1 was 1 after the int32 cast
        out = cp.prefill_attention(q, k, v, scale=16 ** -0.5, window=window)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def _paged_ref(q, kc, vc, tables, lens, scale):
    outs = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        blocks = [int(i) for i in tables[b, :(n + kc.shape[1] - 1) // kc.shape[1]]]
        k = torch.cat([kc[i] for i in blocks])[:n]            # [n, KV, D]
        v = torch.cat([vc[i] for i in blocks])[:n]
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        att = torch.softmax(torch.einsum("hd,nhd->hn", q[b], k) * scale, -1)
        outs.append(torch.einsum("hn,nhd->hd", att, v))
    return torch.stack(outs)


def test_padded_block_tables_are_read_only_as_far_as_each_length():
    g = torch.Generator().manual_seed(1)
    kc, vc = torch.randn(6, 4, 2, 16, generator=g), torch.randn(6, 4, 2, 16, generator=g)
    q = torch.randn(2, 4, 16, generator=g)
    tables = torch.tensor([[3, 5, -1, -1], [0, 1, 2, 4]], dtype=torch.int32)  # -1: unused
    lens = torch.tensor([7, 15], dtype=torch.int32)
    out = cd.paged_decode_attention(q, kc, vc, tables, lens, scale=0.25)
    torch.testing.assert_close(out, _paged_ref(q, kc, vc, tables, lens, 0.25), rtol=1e-4,
                               atol=1e-5)
    tables[0, 1] = 1 << 28          # changed in place: checked again, nothing written
    before = out.clone()
    with pytest.raises(InputError, match="block_tables"):
        cd.paged_decode_attention(q, kc, vc, tables, lens, scale=0.25, out=out)
    assert torch.equal(out, before)


def test_bound_calls_check_their_ints_per_call():
    k = torch.randn(2, 16, 2, 32)
    q = torch.randn(2, 4, 32)
    call = cd.decode_attention_bound(q, k, k, scale=0.1)
    ref = F.scaled_dot_product_attention(q[:, :, None], k[:, :5].repeat_interleave(2, 2)
                                         .transpose(1, 2), k[:, :5].repeat_interleave(2, 2)
                                         .transpose(1, 2), scale=0.1)[:, :, 0]
    torch.testing.assert_close(call(0, 5), ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(ShapeError, match="decode_attention"):
        call(0, 17)


def test_a_table_changed_behind_torchs_back_is_checked_again():
    """Writes through a NumPy view do not move torch's version counter, and a new
    table may reuse a freed one's address: the check compares contents."""
    kc = torch.randn(4, 4, 1, 16)
    q = torch.randn(1, 2, 16)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    lens = torch.tensor([8], dtype=torch.int32)
    cd.paged_decode_attention(q, kc, kc, tables, lens, scale=0.25)
    tables.numpy()[0, 1] = 1 << 28
    with pytest.raises(InputError, match="block_tables"):
        cd.paged_decode_attention(q, kc, kc, tables, lens, scale=0.25)
