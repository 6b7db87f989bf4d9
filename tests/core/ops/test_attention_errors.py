"""FlashAttention bad input: every failure is an AtbError naming the op, what was
expected and what was given, and a given output keeps its contents."""

import numpy as np
import pytest

import atbcore as atb
from oracle import check_error, rand

B, S, H, HKV, D = 2, 4, 4, 2, 8
Q, K, V = rand((B, S, H * D)), rand((B, S, HKV * D), seed=1), rand((B, S, HKV * D), seed=2)
Q4, K4 = rand((B, H, S, D)), rand((B, HKV, S, D), seed=1)
P = {"num_heads": H}
OUT = np.full((B, S, H * D), 3.0, np.float32)

BAD = [
    # (name, params, inputs, error, fragments)
    ("q_rank_2", P, [rand((S, H * D)), K, V], atb.ShapeError, ["'q' rank", "rank 3 or 4"]),
    ("heads_not_dividing_hidden", {"num_heads": 3}, [Q, K, V], atb.ShapeError,
     ["must divide", "32"]),
    ("kv_heads_not_dividing_heads", P, [Q, rand((B, S, 3 * D)), rand((B, S, 3 * D))],
     atb.ShapeError, ["kv heads must divide heads", "given 3"]),
    ("kv_hidden_not_multiple_of_head_dim", P, [Q, rand((B, S, 12)), rand((B, S, 12))],
     atb.ShapeError, ["'k' hidden size"]),
    ("batch_mismatch", P, [Q, rand((3, S, HKV * D)), rand((3, S, HKV * D))], atb.ShapeError,
     ["batch", "expected 2", "given 3"]),
    ("head_dim_mismatch_bnsd", {}, [Q4, rand((B, HKV, S, 16)), rand((B, HKV, S, 16))],
     atb.ShapeError, ["head_dim", "expected 8", "given 16"]),
    ("params_head_dim", {"num_heads": H, "head_dim": 16}, [Q, K, V], atb.ShapeError,
     ["head_dim", "expected 16", "given 8"]),
    ("params_kv_heads", {"num_heads": H, "num_kv_heads": 4}, [Q, K, V], atb.ShapeError,
     ["kv heads", "expected 4", "given 2"]),
    ("params_heads_4d", {"num_heads": 2}, [Q4, K4, K4], atb.ShapeError, ["heads", "given 4"]),
    ("v_shape", P, [Q, K, rand((B, S + 1, HKV * D))], atb.ShapeError, ["'v' shape"]),
    ("k_rank", P, [Q, K4, K4], atb.ShapeError, ["'k' rank"]),
    ("layout_rank", {"num_heads": H, "layout": "BSND"}, [Q, K, V], atb.ShapeError,
     ["'q' rank", "rank 4"]),
    ("q_int", P, [Q.astype(np.int32), K, V], atb.DtypeError, ["'q' dtype", "INT32"]),
    ("k_dtype", P, [Q, K.astype(np.float16), V], atb.DtypeError, ["'k' dtype", "FP16"]),
    ("params_dtype", {"num_heads": H, "dtype": "fp16"}, [Q, K, V], atb.DtypeError,
     ["params dtype", "FP16", "FP32"]),
    ("mask_dtype", P, [Q, K, V, rand((S, S)).astype(np.float64)], atb.DtypeError,
     ["'mask' dtype", "FP64"]),
    ("mask_int", P, [Q, K, V, np.ones((S, S), np.int32)], atb.DtypeError,
     ["'mask' dtype", "INT32"]),
    ("packed_seq_lens_values", {"num_heads": 4, "num_kv_heads": 2},
     [rand((B, S, 64)), None, None, np.array([5, 1], np.int32)], atb.InputError,
     ["'seq_lens' values", "1..4"]),
    ("mask_shape", P, [Q, K, V, rand((S, S + 1))], atb.ShapeError, ["'mask' shape", "[4, 5]"]),
    ("mask_batch", P, [Q, K, V, rand((3, 1, S, S))], atb.ShapeError, ["'mask' shape"]),
    ("mask_rank_1", P, [Q, K, V, rand((S,))], atb.ShapeError, ["'mask' shape"]),
    ("seq_lens_shape", P, [Q, K, V, np.array([1, 2, 3], np.int32)], atb.ShapeError,
     ["'seq_lens' shape", "[2]", "[3]"]),
    ("seq_lens_zero", P, [Q, K, V, np.array([0, 2], np.int32)], atb.InputError,
     ["'seq_lens' values", "1..4", "[0, 2]"]),
    ("seq_lens_too_long", P, [Q, K, V, np.array([5, 2], np.int64)], atb.InputError,
     ["1..4"]),
    ("two_masks", P, [Q, K, V, rand((S, S)), rand((S, S))], atb.InputError, ["given twice"]),
    ("missing_v", P, [Q, K], atb.InputError, ["missing"]),
    ("missing_k", P, [Q, None, V], atb.InputError, ["missing"]),
    ("too_many_inputs", P, [Q, K, V, None, None, None], atb.InputError, ["number of inputs"]),
    ("packed_needs_heads", {}, [rand((B, S, 64))], atb.ShapeError, ["num_heads"]),
    ("packed_hidden", {"num_heads": 4, "num_kv_heads": 2}, [rand((B, S, 60))], atb.ShapeError,
     ["packed QKV hidden size", "8"]),
    ("packed_4d", {}, [Q4], atb.InputError, ["missing"]),
]


@pytest.mark.parametrize("name,params,inputs,exc,frags", BAD, ids=[b[0] for b in BAD])
def test_bad_input(name, params, inputs, exc, frags):
    for backend in ("torch", "numpy"):
        check_error("FlashAttention", params, inputs, exc, *frags, backend=backend,
                    outputs=[OUT])


def test_bad_outputs():
    check_error("FlashAttention", P, [Q, K, V], atb.InputError, "number of outputs",
                outputs=[OUT, OUT])
    check_error("FlashAttention", P, [Q, K, V], atb.ShapeError, "output",
                outputs=[np.full((B, S, 16), 3.0, np.float32)])
    check_error("FlashAttention", P, [Q, K, V], atb.DtypeError, "output",
                outputs=[OUT.astype(np.float16)])


@pytest.mark.parametrize("params,frag", [
    ({"num_heads": 4, "num_kv_heads": 3}, "num_kv_heads must divide"),
    ({"num_heads": 0}, "num_heads"),
    ({"num_heads": 2.5}, "num_heads"),
    ({"window": 0}, "window"),
    ({"scale": "x"}, "scale"),
    ({"scale": 0.0}, "scale"),
    ({"layout": "SBH"}, "layout"),
    ({"causal": "yes"}, "causal"),
    ({"head_numm": 4}, "head_numm"),
])
def test_bad_params(params, frag):
    check_error("FlashAttention", params, [], atb.ParamsError, frag, build_error=True)
    with pytest.raises(atb.ParamsError, match="FlashAttention"):  # aliases name the op too
        atb.Builder().build_operation("MhaV3", params)
    check_error("PagedAttention", params if "layout" not in params else {"bogus": 1}, [],
                atb.ParamsError, build_error=True)
