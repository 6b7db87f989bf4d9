"""UnpadFlashAttention: the torch kernel (C prefill attention over packed sequences)
vs the NumPy reference over dtypes, GQA, causal and empty sequences; torch SDPA run
per sequence as an independent oracle; value errors naming the op."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from atbcore.errors import InputError, ParamsError, ShapeError
from atbcore.numerics import assert_close
from oracle import FLOATS, check_error, check_op, rand


def _qkv(lens, h, hkv, d, dtype="fp32", seed=0):
    return rand((int(sum(lens)), (h + 2 * hkv) * d), dtype, seed), np.array(lens, np.int32)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_against_reference(dtype, causal, heads):
    h, hkv = heads
    qkv, lens = _qkv([5, 0, 17, 1, 9], h, hkv, 16, dtype)
    check_op("UnpadFlashAttention", {"num_heads": h, "num_kv_heads": hkv, "causal": causal},
             [qkv, lens])


@pytest.mark.parametrize("causal", [False, True])
def test_against_sdpa_per_sequence(causal):
    h, hkv, d, lens = 4, 2, 8, [3, 11, 6]
    qkv, ln = _qkv(lens, h, hkv, d, seed=4)
    from atbcore.operation import Builder

    out, = Builder().build_operation("UnpadFlashAttention", {
        "num_heads": h, "num_kv_heads": hkv, "causal": causal, "scale": 0.3}).execute(
        [torch.from_numpy(qkv), torch.from_numpy(ln)])
    t = torch.from_numpy(qkv).double()
    start = 0
    for n in lens:
        rows = t[start:start + n]                                        # [n, (H + 2Hkv) * D]
        q = rows[:, :h * d].view(n, h, d).transpose(0, 1)
        k = rows[:, h * d:(h + hkv) * d].view(n, hkv, d).transpose(0, 1)
        v = rows[:, (h + hkv) * d:].view(n, hkv, d).transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=causal,
                                             scale=0.3, enable_gqa=True)
        assert_close(out[start:start + n], ref[0].transpose(0, 1).reshape(n, h * d), "fp32",
                     f"sequence of {n}")
        start += n


def test_errors_name_the_op():
    qkv, lens = _qkv([3, 4], 2, 2, 8)
    check_error("UnpadFlashAttention", {"num_heads": 2}, [qkv, np.array([3, 5], np.int32)],
                InputError, "UnpadFlashAttention", "seq_lens")
    check_error("UnpadFlashAttention", {"num_heads": 2}, [qkv, np.array([-1, 8], np.int32)],
                InputError, "UnpadFlashAttention", "seq_lens")
    check_error("UnpadFlashAttention", {"num_heads": 3}, [qkv, lens], ShapeError,
                "UnpadFlashAttention", "qkv")
    check_error("UnpadFlashAttention", {}, [qkv, lens], ParamsError, "num_heads",
                build_error=True)
    check_error("UnpadFlashAttention", {"num_heads": 2, "window": 4}, [qkv, lens], ParamsError,
                "window", build_error=True)
