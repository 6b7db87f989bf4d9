"""``atb.compile(model, tensor_parallel=2)`` on 2 real gloo processes: generate gives
Hugging Face's greedy tokens on every rank (the cache reset between calls), seeded
sampling the same tokens on both ranks; refusals name what is wrong."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

import atb_torch as atb
from atbcore.errors import CapabilityError, ParamsError
from tiny_models import tiny

sys.path.insert(0, os.path.dirname(__file__))
from dist_ranks import run_ranks  # noqa: E402
from tp_workers import run_compiled  # noqa: E402

STEPS = 8
IDS = torch.randint(3, 250, (2, 6), generator=torch.Generator().manual_seed(11)).numpy()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
def test_compiled_tp2_generate_equals_hugging_face(arch):
    got = run_ranks(run_compiled, (arch, IDS, STEPS), world=2, timeout=240)
    hf = tiny(arch)
    ids = torch.as_tensor(IDS)
    want = hf.generate(ids, max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
    want1 = hf.generate(ids[:1], max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
    for r, g in enumerate(got):
        np.testing.assert_array_equal(g["greedy"], want.numpy(), err_msg=f"rank {r}")
        np.testing.assert_array_equal(g["again"], want1.numpy(), err_msg=f"rank {r}")
    np.testing.assert_array_equal(got[0]["sampled"], got[1]["sampled"])
    assert got[0]["sampled"].shape == (2, 6 + STEPS)


def test_tensor_parallel_refusals():
    hf = tiny("llama")
    with pytest.raises(CapabilityError, match="world size 1"):
        atb.compile(hf, tensor_parallel=2)  # no process group of 2 ranks here
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ParamsError, match="tensor_parallel"):
            atb.compile(hf, tensor_parallel=bad)
    with pytest.raises(CapabilityError, match="quantize"):
        atb.compile(hf, tensor_parallel=2, quantize="w8")
    assert atb.compile(hf, tensor_parallel=1).generate is not None  # one rank: the usual path
