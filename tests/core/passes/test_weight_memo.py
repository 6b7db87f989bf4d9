"""Weights the pipeline concatenates (merged gate|up, QKV) are made once per set of
source arrays inside a ``weight_memo`` (a GraphOp's lowerings share one), and
outside a memo each concatenation is its own array. Oracle: ``np.concatenate``.
(A compiled decoder's two lowerings sharing them: test_core_runner.py.)"""

import numpy as np
import torch

from atbcore.passes.rewrite import concat_weights, weight_memo


def test_concat_within_a_memo_is_made_once_per_source_memory():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal((5, 4)).astype(
        np.float32)
    memo: dict = {}
    with weight_memo(memo):
        first = concat_weights([a, b])
        again = concat_weights([a[:], torch.from_numpy(b)])  # new objects, same memory
        other = concat_weights([b, a])
        cols = concat_weights([a, a], axis=1)
    np.testing.assert_array_equal(first, np.concatenate([a, b]))
    np.testing.assert_array_equal(other, np.concatenate([b, a]))
    np.testing.assert_array_equal(cols, np.concatenate([a, a], axis=1))
    assert again is first and other is not first and len(memo) == 3
    outside = concat_weights([a, b])
    assert outside is not first and concat_weights([a, b]) is not outside  # no memo: fresh
    np.testing.assert_array_equal(outside, first)
