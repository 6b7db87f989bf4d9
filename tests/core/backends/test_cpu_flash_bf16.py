"""The bf16 prefill attention's VDPBF16PS scores (csrc/flash_bf16.c, where the CPU
has AVX512_BF16): odd head dims and key counts (the pair tails), against the float64
NumPy reference, and 1 vs 2 threads bit-equal. (test_cpu_prefill_attention.py runs
every even head dim through it too.)"""

import numpy as np
import pytest
import torch

from atbcore.backends.cpu_kernels import available
from atbcore.numerics import assert_close
from atbcore.ops.attention import ref_attention

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler here: C kernels absent")


@pytest.mark.parametrize("d", [33, 7, 64])
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 5)])
def test_bf16_attention_odd_dims(d, causal, window):
    from atbcore.backends.cpu_kernels.torch_prefill import prefill_attention

    g = torch.Generator().manual_seed(d)
    lens, h, kv = [1, 3, 67, 129], 4, 2
    t = sum(lens)
    q = torch.randn(t, h, d, generator=g).bfloat16()
    k = torch.randn(t, kv, d, generator=g).bfloat16()
    v = torch.randn(t, kv, d, generator=g).bfloat16()
    scale = d ** -0.5
    y = prefill_attention(q, k, v, scale=scale, q_lens=lens, causal=causal, window=window,
                          out=torch.empty(t, h, d))
    out, a = [], 0
    for n in lens:
        qs, ks, vs = (x[a:a + n].double().numpy().transpose(1, 0, 2)[None] for x in (q, k, v))
        out.append(ref_attention(qs, ks, vs, scale=scale, causal=causal,
                                 window=window)[0].transpose(1, 0, 2))
        a += n
    ref = np.concatenate(out).astype(np.float32)
    # fp32 outputs: the sums as the fp32 tiles' (exact products, fp32 sums)
    assert_close(y, ref, "fp32", "bf16 attention, fp32 out")
    n0, ys = torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            ys.append(prefill_attention(q, k, v, scale=scale, q_lens=lens, causal=causal,
                                        window=window))
    finally:
        torch.set_num_threads(n0)
    assert torch.equal(ys[0], ys[1])
