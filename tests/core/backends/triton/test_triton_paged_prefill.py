"""The Triton PagedAttention for several new tokens per sequence (the core plan's
prefill and chunks over a paged cache), through the torch backend's "cuda" kernel on
CPU tensors in Triton's interpreter, against the op's NumPy reference."""

import numpy as np
import pytest

import test_triton_kernels as tk
from atbcore.numerics import assert_close
from oracle import FLOATS, rand
from test_triton_kernels import _run


@pytest.fixture(autouse=True)
def _on(device):
    tk.DEVICE = device


def _inputs(dtype, lens, q_lens, h=4, hkv=2, d=40, nb=30, bs=4, mb=8, seed=40):
    rng = np.random.default_rng(seed)
    tables = rng.permutation(nb)[:len(lens) * mb].reshape(len(lens), mb) % nb
    return {"query": rand((sum(q_lens), h, d), dtype, seed + 1),
            "key_cache": rand((nb, bs, hkv, d), dtype, seed + 2),
            "value_cache": rand((nb, bs, hkv, d), dtype, seed + 3),
            "block_tables": tables.astype(np.int32),
            "context_lens": np.array(lens, np.int32), "q_seq_lens": np.array(q_lens, np.int32)}


CASES = [  # (context lens, new tokens per sequence, params)
    ((7, 4), (7, 4), {}),                        # two prompts of different lengths
    ((21, 3, 9), (5, 3, 1), {}),                 # a chunk over a past, a prompt, a decode row
    ((13, 6), (4, 6), {"window": 3}),
    ((9, 5), (3, 5), {"causal": False}),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("lens,q_lens,params", CASES)
def test_paged_prefill_attention(dtype, lens, q_lens, params):
    (o,), (ref,), _ = _run("PagedAttention", params, _inputs(dtype, lens, q_lens))
    assert_close(o, ref, dtype, what=f"triton paged prefill {lens} {q_lens} {params}")
