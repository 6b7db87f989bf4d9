"""The C row gather on torch tensors (``torch_gather.gather_rows_into``), which a bound
CPU Embedding and last-token Gather run: rows equal to ``index_select`` (odd widths,
every element size, int32/int64 ids), an id outside the table refused with nothing
written, tensors it does not take handed back; in a compiled decoder a decode step
with an id past the vocabulary raises InputError and the next good step still matches
the eager model."""

import numpy as np
import pytest
import torch

from atbcore.backends.cpu_kernels import available
from atbcore.errors import InputError

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler here: C kernels absent")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8,
                                   torch.float64])
@pytest.mark.parametrize("idt", [torch.int32, torch.int64])
@pytest.mark.parametrize("rows,width,n", [(37, 13, 1), (5, 512, 3), (1000, 1, 7)])
def test_gather_rows_into_equals_index_select(dtype, idt, rows, width, n):
    from atbcore.backends.cpu_kernels.torch_gather import GATHER_OUT_OF_RANGE, gather_rows_into

    g = torch.Generator().manual_seed(rows + width + n)
    table = (torch.randn(rows, width, generator=g) * 50).to(dtype)
    ids = torch.randint(0, rows, (n,), generator=g).to(idt)
    out = torch.full((n, width), 3, dtype=dtype)
    call = gather_rows_into(out, dtype)
    assert call(table, ids) == 0
    np.testing.assert_array_equal(out.view(torch.uint8).numpy(),
                                  torch.index_select(table, 0, ids).view(torch.uint8).numpy())
    before = out.clone()
    bad = ids.clone()
    bad[-1] = rows
    assert call(table, bad) == GATHER_OUT_OF_RANGE
    bad[-1] = -1
    assert call(table, bad) == GATHER_OUT_OF_RANGE
    assert torch.equal(out.view(torch.uint8), before.view(torch.uint8))  # nothing written
    # not its case: handed back (the caller's torch op runs)
    assert call(torch.cat([table, table], 1)[:, :width], ids) == 1  # strided rows
    assert call(table, ids.float()) == 1
    assert call(table, ids[:0]) == 1


def test_gather_rows_into_refuses_outputs_it_cannot_fill():
    from atbcore.backends.cpu_kernels.torch_gather import gather_rows_into

    assert gather_rows_into(torch.empty(4, 6).t(), torch.float32) is None
    assert gather_rows_into(torch.empty(0, 6), torch.float32) is None
    assert gather_rows_into(torch.empty(2, 6), torch.bfloat16) is None


def test_decode_step_with_an_id_past_the_vocabulary():
    from transformers import LlamaConfig, LlamaForCausalLM

    from atb_torch.models import compile as atb_compile

    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     vocab_size=97)).eval()
    r = atb_compile(m).atb_runner
    ids = torch.tensor([[3, 9, 27, 81]])
    cache = r.new_cache(1, 16)
    r.prefill(ids, cache)
    r.decode(torch.tensor([5]), cache)  # the steady (bound) decode plan
    n = cache.length
    with pytest.raises(InputError, match="out of range"):
        r.decode(torch.tensor([97]), cache)
    assert cache.length == n
    got = r.decode(torch.tensor([7]), cache).clone()
    with torch.no_grad():
        ref = m(torch.tensor([[3, 9, 27, 81, 5, 7]])).logits[:, -1]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
