"""One small, valid call of every op: params and NumPy inputs for a dtype.

``atb verify`` runs these on each backend against the NumPy reference, and the
fuzz tests start from them before bending shapes, values and params. A sample is
a callable ``make(dtype, rng) -> (params, inputs)``; ``dtype`` is a float dtype
name (``"fp32"``, ``"fp16"``, ``"bf16"``), ``"int8"`` for the ops with a
quantized form (``INT8_OPS``), or ``"w4"`` / ``"w8a8"`` for the quantized Linears
(``QUANT_OPS``).

    params, inputs = sample_call("RmsNorm", "fp16", seed=0)
    Builder().build_operation("RmsNorm", params).execute(inputs)
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..dtypes import Dtype

__all__ = ["SAMPLES", "INT8_OPS", "QUANT_OPS", "sample_call", "sample_dtypes"]

Sample = Callable[[str, np.random.Generator], "tuple[dict[str, Any], list[np.ndarray]]"]


def _f(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, scale: float = 1.0
       ) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(Dtype.of(dtype).numpy)


def _act(kind: str, gated: bool = False) -> Sample:
    def make(dt, rng):
        params = {"activation_type": kind} if kind else {}
        return params, [_f(rng, (3, 16 if gated else 8), dt)]
    return make


def _attention(dt, rng):
    # GQA, causal, sliding window: the paths a real decoder takes
    return ({"num_heads": 4, "num_kv_heads": 2, "causal": True, "window": 5},
            [_f(rng, (2, 7, 4 * 8), dt), _f(rng, (2, 7, 2 * 8), dt), _f(rng, (2, 7, 2 * 8), dt)])


def _rope(dt, rng):
    return ({"num_heads": 2, "num_kv_heads": 1, "head_dim": 8},
            [_f(rng, (2, 5, 16), dt), _f(rng, (2, 5, 8), dt),
             np.array([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]], dtype=np.int64)])


def _rope_attention(dt, rng):
    return ({"num_heads": 2, "num_kv_heads": 1, "head_dim": 8, "causal": True},
            [_f(rng, (1, 6, 16), dt), _f(rng, (1, 6, 8), dt), _f(rng, (1, 6, 8), dt)])


def _rope_cache(dt, rng):
    return ({"num_heads": 2, "num_kv_heads": 1, "head_dim": 8},
            [_f(rng, (2, 3, 16), dt), _f(rng, (2, 3, 8), dt), _f(rng, (2, 3, 8), dt),
             np.zeros((2, 6, 1, 8), Dtype.of(dt).numpy), np.zeros((2, 6, 1, 8), Dtype.of(dt).numpy),
             np.array([[0, 1, 2], [2, 3, 4]], dtype=np.int64)])


def _linear(dt, rng):
    if dt in ("int8", "w8a8"):
        w = rng.integers(-127, 128, (6, 8)).astype(np.int8)
        return ({"quant": "w8" if dt == "int8" else "w8a8"},
                [_f(rng, (3, 8), "fp32"), w, (rng.uniform(0.01, 0.05, 6)).astype(np.float32)])
    if dt == "w4":  # 40 inputs: one whole group of 32 and a tail; symmetric (z = 8)
        codes = rng.integers(0, 16, (6, 40)).astype(np.uint8)
        scales = rng.uniform(0.01, 0.05, (6, 2)).astype(np.float16)
        return ({"quant": "w4"}, [_f(rng, (3, 40), "fp32"), codes, scales])
    return {}, [_f(rng, (3, 8), dt), _f(rng, (6, 8), dt, 0.3), _f(rng, (6,), dt)]


def _linear_act(dt, rng):
    params, ins = _linear(dt, rng)
    return {**params, "activation_type": "gelu"}, ins


def _norm_linear(dt, rng):
    params, ins = _linear(dt, rng)
    nw = (1 + 0.1 * rng.standard_normal(ins[0].shape[-1])).astype(ins[0].dtype)
    return {**params, "eps": 1e-5}, [ins[0], nw, *ins[1:]]


def _ffn(dt, rng):
    return ({"activation_type": "swiglu"},
            [_f(rng, (3, 8), dt), _f(rng, (12, 8), dt, 0.3), _f(rng, (12, 8), dt, 0.3),
             _f(rng, (8, 12), dt, 0.3)])


def _moe(dt, rng):
    return ({"top_k": 2}, [_f(rng, (5, 8), dt), _f(rng, (4, 8), dt), _f(rng, (4, 12, 8), dt, 0.3),
                           _f(rng, (4, 8, 6), dt, 0.3)])


def _paged(dt, rng):
    kc, vc = _f(rng, (4, 4, 1, 8), dt), _f(rng, (4, 4, 1, 8), dt)
    return ({"num_heads": 2}, [_f(rng, (2, 2, 8), dt), kc, vc,
                               np.array([[2, 0], [1, 3]], dtype=np.int32),
                               np.array([6, 3], dtype=np.int32)])


def _unpad_attention(dt, rng):
    # three packed sequences, one empty, GQA: what an encoder batch looks like
    return ({"num_heads": 4, "num_kv_heads": 2},
            [_f(rng, (7, 8 * 8), dt), np.array([4, 0, 3], dtype=np.int32)])


def _reshape_and_cache(dt, rng):
    kc = np.zeros((3, 4, 2, 8), Dtype.of(dt).numpy)
    return ({}, [_f(rng, (5, 2, 8), dt) if dt != "int8" else
                 rng.integers(-100, 100, (5, 2, 8)).astype(np.int8) for _ in range(2)]
            + [kc, kc.copy(), np.array([0, 5, -1, 11, 6], dtype=np.int64)])


def _int8_cache(rng, shape):
    """An int8 cache block and its fp16 scales (the int8 KV cache ops' caches)."""
    return (rng.integers(-127, 128, shape).astype(np.int8),
            (rng.random(shape[:-1]) * 0.02 + 0.001).astype(np.float16))


def _reshape_and_cache_int8(dt, rng):
    kc, ks = _int8_cache(rng, (3, 4, 2, 8))
    vc, vs = _int8_cache(rng, (3, 4, 2, 8))
    return ({}, [_f(rng, (5, 2, 8), dt), _f(rng, (5, 2, 8), dt), kc, vc, ks, vs,
                 np.array([0, 5, -1, 11, 6], dtype=np.int64)])


def _paged_int8(dt, rng):
    kc, ks = _int8_cache(rng, (4, 4, 1, 8))
    vc, vs = _int8_cache(rng, (4, 4, 1, 8))
    return ({"num_heads": 2}, [_f(rng, (2, 2, 8), dt), kc, vc, ks, vs,
                               np.array([[2, 0], [1, 3]], dtype=np.int32),
                               np.array([6, 3], dtype=np.int32)])


SAMPLES: dict[str, Sample] = {
    "Gelu": lambda dt, rng: ({}, [_f(rng, (3, 8), dt)]),
    "QuickGelu": lambda dt, rng: ({}, [_f(rng, (3, 8), dt)]),
    "SiLU": lambda dt, rng: ({}, [_f(rng, (3, 8), dt)]),
    "Relu": lambda dt, rng: ({}, [_f(rng, (3, 8), dt)]),
    "SwiGLU": lambda dt, rng: ({}, [_f(rng, (3, 16), dt)]),
    "GeGLU": lambda dt, rng: ({}, [_f(rng, (3, 8), dt), _f(rng, (3, 8), dt)]),
    "Activation": _act("gelu_tanh"),
    "FlashAttention": _attention,
    "UnpadFlashAttention": _unpad_attention,
    "AllReduce": lambda dt, rng: ({}, [_f(rng, (3, 8), dt)]),
    "AllGather": lambda dt, rng: ({"axis": -1}, [_f(rng, (3, 8), dt)]),
    "ReduceScatter": lambda dt, rng: ({"op": "max"}, [_f(rng, (4, 8), dt)]),
    "VocabParallelEmbedding": lambda dt, rng: ({}, [_f(rng, (6, 4), dt),
                                                    np.array([[5, 0], [1, 1]], np.int32)]),
    "Broadcast": lambda dt, rng: ({"root": 0}, [_f(rng, (3, 8), dt)]),
    "AllToAll": lambda dt, rng: ({"axis": 1}, [_f(rng, (3, 8), dt)]),
    "LinearParallel": lambda dt, rng: ({"type": "linear_all_reduce"},
                                       [_f(rng, (3, 8), dt), _f(rng, (5, 8), dt),
                                        _f(rng, (5,), dt)]),
    "Elewise": lambda dt, rng: ({"elewise_type": "mul"}, [_f(rng, (3, 8), dt), _f(rng, (8,), dt)]),
    "ResidualAdd": lambda dt, rng: ({}, [_f(rng, (3, 8), dt), _f(rng, (3, 8), dt)]),
    "FusedFeedForward": _ffn,
    "Linear": _linear,
    "MatMul": lambda dt, rng: ({"transpose_b": True}, [_f(rng, (2, 3, 8), dt),
                                                       _f(rng, (2, 5, 8), dt)]),
    "RoPE": _rope,
    "RopeFlashAttention": _rope_attention,
    "LinearActivation": _linear_act,
    "RmsNormLinear": _norm_linear,
    "Transpose": lambda dt, rng: ({"perm": [1, 0, 2]}, [_f(rng, (2, 3, 4), dt)]),
    "Reshape": lambda dt, rng: ({"shape": [4, -1]}, [_f(rng, (2, 3, 4), dt)]),
    "Split": lambda dt, rng: ({"sizes": [1, 3]}, [_f(rng, (2, 4), dt)]),
    "Concat": lambda dt, rng: ({"dim": 0}, [_f(rng, (2, 4), dt), _f(rng, (1, 4), dt)]),
    "Slice": lambda dt, rng: ({"offsets": [1, 0], "sizes": [-1, 2]}, [_f(rng, (3, 4), dt)]),
    "Gather": lambda dt, rng: ({"axis": 1}, [_f(rng, (2, 5), dt),
                                             np.array([4, 0, 2], dtype=np.int64)]),
    "Embedding": lambda dt, rng: ({}, [_f(rng, (6, 4), dt), np.array([[5, 0], [1, 1]], np.int32)]),
    "Softmax": lambda dt, rng: ({}, [_f(rng, (3, 8), dt, 3.0)]),
    "ScaledMaskedSoftmax": lambda dt, rng: ({"scale": 0.5, "causal": True},
                                            [_f(rng, (2, 4, 4), dt, 3.0)]),
    "MoE": _moe,
    "LayerNorm": lambda dt, rng: ({}, [_f(rng, (3, 8), dt), _f(rng, (8,), dt), _f(rng, (8,), dt)]),
    "RmsNorm": lambda dt, rng: ({}, [_f(rng, (3, 8), dt), _f(rng, (8,), dt)]),
    "AddLayerNorm": lambda dt, rng: ({}, [_f(rng, (3, 8), dt), _f(rng, (3, 8), dt),
                                          _f(rng, (8,), dt), _f(rng, (8,), dt)]),
    "AddRmsNorm": lambda dt, rng: ({}, [_f(rng, (3, 8), dt), _f(rng, (3, 8), dt),
                                        _f(rng, (8,), dt)]),
    "Unpad": lambda dt, rng: ({}, [_f(rng, (2, 4, 3), dt), np.array([3, 1], np.int64)]),
    "Pad": lambda dt, rng: ({"max_seq_len": 4}, [_f(rng, (4, 3), dt), np.array([3, 1], np.int64)]),
    "ReshapeAndCache": _reshape_and_cache,
    "PagedAttention": _paged,
    "ReshapeAndCacheInt8": _reshape_and_cache_int8,
    "PagedAttentionInt8": _paged_int8,
    "ReduceMean": lambda dt, rng: ({"dim": [0, 2]}, [_f(rng, (2, 3, 4), dt)]),
    "ReduceSum": lambda dt, rng: ({"dim": 1, "keepdim": True}, [_f(rng, (2, 3, 4), dt)]),
    "RopeKVCache": _rope_cache,
    "Argmax": lambda dt, rng: ({"dim": 0}, [_f(rng, (4, 5), dt)]),
    "TopkToppSampling": lambda dt, rng: ({"top_k": 3, "top_p": 0.9, "seed": 7},
                                         [_f(rng, (3, 10), dt, 2.0)]),
}

# Ops with an int8 form: weight-only int8 Linear, int8 KV caches.
INT8_OPS = frozenset({"Linear", "LinearActivation", "RmsNormLinear", "ReshapeAndCache"})
# Ops with "w4" / "w8a8" forms (4-bit group weights; int8 rows x int8 weights)
QUANT_OPS = frozenset({"Linear", "RmsNormLinear"})


def sample_dtypes(op: str) -> list[str]:
    """The dtypes (and quantized forms) ``op`` has a sample for."""
    return (["fp32", "fp16", "bf16"] + (["int8"] if op in INT8_OPS else [])
            + (["w4", "w8a8"] if op in QUANT_OPS else []))


def sample_call(op: str, dtype: str = "fp32", seed: int = 0) -> tuple[dict[str, Any], list]:
    """Fresh ``(params, inputs)`` of the sample call of ``op`` (a new copy each time,
    so an in-place op's caches start clean)."""
    return SAMPLES[op](dtype, np.random.default_rng(seed))
