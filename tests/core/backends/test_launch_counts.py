"""Declared launches are the truth: for every registered torch kernel, a small valid
call is run under a ``TorchDispatchMode`` counter (views, ``empty*`` and metadata ops
not counted; each C kernel call counts one) and the count must equal the kernel's
declared ``launches``. A new kernel without an example here fails by name.

The examples are the common fp32 CPU case each kernel is declared for (the fused
LLaMA layer's shapes where it uses the op). A second test runs the same loop in a
process with the C kernels turned off, so the torch-composite counts are honest too.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from atbcore.backends import get_backend
from atbcore.backends.cpu_kernels import available
from atbcore.backends.cpu_kernels.counting import LaunchCounter
from atbcore.backends.torch import TORCH_KERNELS
from atbcore.ops.registry import get_op

get_backend("torch").load()


def _r(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _i(values):
    return torch.tensor(values, dtype=torch.int64)


B, S, H, N = 2, 8, 64, 4  # the acceptance layer's batch, seq, hidden, heads


def examples() -> dict[str, tuple[dict, dict]]:
    """op -> (params, inputs by name): one small valid fp32 CPU call per kernel."""
    x = _r(B, S, H, seed=1)
    w = _r(H, seed=2) + 1
    act = {"x": _r(B, S, 128, seed=3)}
    return {
        "Activation": ({"activation_type": "swiglu"}, act),
        "AddLayerNorm": ({}, {"x": x, "residual": _r(B, S, H, seed=4), "weight": w,
                              "bias": _r(H, seed=5)}),
        "AddRmsNorm": ({}, {"x": x, "residual": _r(B, S, H, seed=4), "weight": w}),
        "AllReduce": ({}, {"x": x}),
        "AllGather": ({"axis": -1}, {"x": x}),
        "AllToAll": ({"axis": 1}, {"x": x}),
        "Broadcast": ({}, {"x": x}),
        "VocabParallelEmbedding": ({}, {"weight": _r(10, H), "ids": _i([[1, 2], [3, 9]])}),
        "ReduceScatter": ({"axis": 1}, {"x": x}),
        "LinearParallel": ({}, {"x": x, "weight": _r(3 * H, H, seed=11), "bias": _r(3 * H)}),
        "Argmax": ({}, {"x": x}),
        "Concat": ({"dim": -1}, {"x0": x, "x1": x}),
        "Elewise": ({"elewise_type": "add"}, {"x": x, "y": x}),
        "Embedding": ({}, {"weight": _r(10, H), "ids": _i([[1, 2], [3, 9]])}),
        "FlashAttention": ({"num_heads": N, "causal": True},
                           {"q": x, "k": _r(B, S, H, seed=6), "v": _r(B, S, H, seed=7)}),
        # the fused layer's FFN: merged gate|up, SwiGLU, residual
        "FusedFeedForward": ({"gate_up_merged": True, "has_residual": True},
                             {"x": x, "gate_up_w": _r(256, H, seed=8), "down_w": _r(H, 128, seed=9),
                              "residual": _r(B, S, H, seed=10)}),
        "Gather": ({"axis": 0}, {"x": _r(10, 4), "indices": _i([1, 3, 5])}),
        "GeGLU": ({}, act),
        "Gelu": ({}, {"x": x}),
        "LayerNorm": ({}, {"x": x, "weight": w, "bias": _r(H, seed=5)}),
        "Linear": ({}, {"x": x, "weight": _r(3 * H, H, seed=11)}),
        "LinearActivation": ({"activation_type": "gelu"}, {"x": x, "weight": _r(128, H, seed=12)}),
        "MatMul": ({}, {"a": _r(B, N, S, 16), "b": _r(B, N, 16, S, seed=1)}),
        # one decode token, top-2: MoE dispatches 11 + 6 per expert that got tokens
        "MoE": ({"num_experts": 4, "top_k": 2},
                {"x": _r(1, 16), "router_w": _r(4, 16, seed=1), "w_gate_up": _r(4, 64, 16, seed=2),
                 "w_down": _r(4, 16, 32, seed=3)}),
        "Pad": ({}, {"packed": _r(5, 8), "seq_lens": _i([2, 3])}),
        "PagedAttention": ({}, {"query": _r(2, 4, 8), "key_cache": _r(4, 4, 2, 8, seed=1),
                                "value_cache": _r(4, 4, 2, 8, seed=2),
                                "block_tables": _i([[0, 1], [2, 3]]), "context_lens": _i([5, 7])}),
        "PagedAttentionInt8": ({}, {"query": _r(2, 4, 8),
                                    "key_cache": torch.ones(4, 4, 2, 8, dtype=torch.int8),
                                    "value_cache": torch.ones(4, 4, 2, 8, dtype=torch.int8),
                                    "key_scale": torch.full((4, 4, 2), 0.01, dtype=torch.half),
                                    "value_scale": torch.full((4, 4, 2), 0.02,
                                                              dtype=torch.half),
                                    "block_tables": _i([[0, 1], [2, 3]]),
                                    "context_lens": _i([5, 7])}),
        "QuickGelu": ({}, {"x": x}),
        "ReduceMean": ({"dim": -1}, {"x": x}),
        "ReduceSum": ({"dim": -1}, {"x": x}),
        "Relu": ({}, {"x": x}),
        "Reshape": ({"shape": (B, -1)}, {"x": x}),
        "ReshapeAndCache": ({}, {"key": _r(3, 2, 8), "value": _r(3, 2, 8, seed=1),
                                 "key_cache": _r(4, 4, 2, 8, seed=2),
                                 "value_cache": _r(4, 4, 2, 8, seed=3),
                                 "slot_mapping": _i([0, 5, -1])}),
        "ReshapeAndCacheInt8": ({}, {"key": _r(3, 2, 8), "value": _r(3, 2, 8, seed=1),
                                     "key_cache": torch.zeros(4, 4, 2, 8, dtype=torch.int8),
                                     "value_cache": torch.zeros(4, 4, 2, 8, dtype=torch.int8),
                                     "key_scale": torch.zeros(4, 4, 2, dtype=torch.half),
                                     "value_scale": torch.zeros(4, 4, 2, dtype=torch.half),
                                     "slot_mapping": _i([0, 5, -1])}),
        "ResidualAdd": ({}, {"x": x, "residual": x}),
        "RmsNorm": ({}, {"x": x, "weight": w}),
        "RmsNormLinear": ({"eps": 1e-6}, {"x": x, "norm_weight": w,
                                           "weight": _r(3 * H, H, seed=13)}),
        "RoPE": ({"num_heads": N}, {"q": x, "k": _r(B, S, H, seed=6)}),
        # the fused layer's attention: packed qkv, causal
        "RopeFlashAttention": ({"num_heads": N, "causal": True}, {"q": _r(B, S, 3 * H, seed=13)}),
        "RopeKVCache": ({"num_heads": N, "num_kv_heads": 2},
                        {"q": x, "k": _r(B, S, 32, seed=6),
                         "v": _r(B, S, 32, seed=7), "key_cache": torch.zeros(B, 16, 2, 16),
                         "value_cache": torch.zeros(B, 16, 2, 16),
                         "position_ids": torch.arange(S)}),
        "ScaledMaskedSoftmax": ({"scale": 0.25, "causal": True},
                                {"x": _r(B, N, S, S), "mask": _r(S, S, seed=1)}),
        "SiLU": ({}, {"x": x}),
        "Slice": ({"offsets": (0, 0, 0), "sizes": (1, -1, 8)}, {"x": x}),
        "Softmax": ({}, {"x": _r(B, N, S, S)}),
        "Split": ({"num": 2}, {"x": x}),
        "SwiGLU": ({}, act),
        "TopkToppSampling": ({"top_k": 5, "top_p": 0.9, "seed": 0}, {"logits": _r(2, 32)}),
        "Transpose": ({"perm": (0, 2, 1)}, {"x": x}),
        "Unpad": ({}, {"x": _r(2, 4, 8), "seq_lens": _i([2, 3])}),
        # one packed sequence (the torch composite runs SDPA per sequence)
        "UnpadFlashAttention": ({"num_heads": N}, {"qkv": _r(S, 3 * H, seed=14),
                                                   "seq_lens": _i([S])}),
    }


def count(op: str, params: dict, ins: dict) -> LaunchCounter:
    p = get_op(op).make_params(params)
    bound = dict.fromkeys(get_op(op).input_names) | ins
    fn = TORCH_KERNELS[op].fn
    fn(p, bound)  # warm caches (RoPE tables, transposed weights) outside the count
    with torch.no_grad(), LaunchCounter() as c:
        fn(p, bound)
    return c


def declared(op: str, params: dict, ins: dict) -> int:
    """The kernel's declared launches for this call: its ``launches_for`` at the call's
    input shapes where it has one, else ``launches``."""
    k = TORCH_KERNELS[op]
    if k.launches_for is None:
        return k.launches
    shapes = {n: tuple(t.shape) for n, t in ins.items() if t is not None}
    return k.launches_for(get_op(op).make_params(params), shapes)


def measured() -> dict[str, tuple[int, int, list[str]]]:
    """op -> (declared, counted, ops) for every registered kernel with an example."""
    ex = examples()
    return {op: (declared(op, *ex[op]), c.launches, c.ops) for op in sorted(TORCH_KERNELS)
            if op in ex for c in [count(op, *ex[op])]}


def test_every_kernel_has_an_example():
    missing = sorted(set(TORCH_KERNELS) - set(examples()))
    assert not missing, f"add a launch-count example for {missing}"


@pytest.mark.parametrize("op", sorted(examples()))
def test_declared_launches_equal_the_counted_kernels(op):
    declared, counted, ops = measured_one(op)
    assert counted == declared, f"{op}: declared {declared}, dispatched {counted}: {ops}"


def measured_one(op: str) -> tuple[int, int, list[str]]:
    c = count(op, *examples()[op])
    return declared(op, *examples()[op]), c.launches, c.ops


# op -> the one C kernel its call must be
C_KERNEL = {"RmsNorm": "rms_norm", "AddRmsNorm": "rms_norm", "LayerNorm": "layer_norm",
            "AddLayerNorm": "layer_norm", "RoPE": "rope", "RopeKVCache": "rope",
            "SwiGLU": "activation", "GeGLU": "activation", "Gelu": "activation",
            "QuickGelu": "activation", "SiLU": "activation", "Activation": "activation",
            "Softmax": "softmax", "ScaledMaskedSoftmax": "softmax"}


@pytest.mark.skipif(not available(), reason="the C kernels are not built on this machine")
@pytest.mark.parametrize("op", sorted(C_KERNEL))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_ops_are_one_c_kernel_in_every_float_type(op, dtype):
    params, ins = examples()[op]
    ins = {n: (t.to(dtype) if t.is_floating_point() and n != "mask" else t) for n, t in ins.items()}
    assert count(op, params, ins).ops == [C_KERNEL[op]]


def test_counter_sees_views_as_free_and_compute_as_launches():
    x = _r(4, 8)
    with LaunchCounter() as c:
        y = x.view(8, 4).t()       # views
        z = torch.empty_like(x)    # allocation only
        torch.add(x, x, out=z)     # one kernel
        y.contiguous()             # a copy: one kernel
    assert c.ops == ["aten.add", "aten.clone"] and c.launches == 2


_SUBPROCESS = """
import json, sys
sys.path[:0] = {paths!r}
import test_launch_counts as t
print(json.dumps({{op: [d, n, ops] for op, (d, n, ops) in t.measured().items()}}))
"""


@pytest.mark.skipif(not available(), reason="without C kernels the main test covers this")
def test_composite_counts_are_honest_without_the_c_kernels():
    env = dict(os.environ, ATB_CPU_KERNELS="0")
    here = os.path.dirname(__file__)
    paths = [here, os.path.join(here, "..", "..")]
    r = subprocess.run([sys.executable, "-c", _SUBPROCESS.format(paths=paths)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    got = json.loads(r.stdout.strip().splitlines()[-1])
    wrong = {op: v for op, v in got.items() if v[0] != v[1]}
    assert not wrong, f"composite launches declared != dispatched: {wrong}"
    # and the C kernels really cut the fused ops' launches
    assert got["RmsNorm"][1] > TORCH_KERNELS["RmsNorm"].launches == 1
    assert got["RoPE"][1] > TORCH_KERNELS["RoPE"].launches == 1
    np.testing.assert_array_less(
        [TORCH_KERNELS[o].launches for o in ("AddRmsNorm", "SwiGLU", "FusedFeedForward")],
        [got[o][1] for o in ("AddRmsNorm", "SwiGLU", "FusedFeedForward")])
