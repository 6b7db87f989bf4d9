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
    made = [k for k in memo if k[0] != "made"]  # concatenations by their sources
    assert again is first and other is not first and len(made) == 3
    outside = concat_weights([a, b])
    assert outside is not first and concat_weights([a, b]) is not outside  # no memo: fresh
    np.testing.assert_array_equal(outside, first)


def test_memo_holds_a_concatenation_weakly_and_packs_it_once_by_its_sources():
    """Once the layout pass packed a concatenation, the memo keeps only the packed form:
    the unpacked array dies, and concatenating the same sources again (a second
    lowering) finds the same packed weight. Oracle: np.concatenate and unpack."""
    import gc
    import weakref

    from atbcore.graph.packed import PANELS, Layout, pack, unpack
    from atbcore.passes.rewrite import packed_once

    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((40, 8)).astype(np.float32), rng.standard_normal((33, 8)).astype(
        np.float32)
    memo: dict = {}
    lay = Layout(PANELS)
    with weight_memo(memo):
        cat = concat_weights([a, b])
        p1 = packed_once(cat, lay, pack)
        gone = weakref.ref(cat)
        del cat
        gc.collect()
        assert gone() is None  # the unpacked concatenation is not kept
        p2 = packed_once(concat_weights([a, b]), lay, pack)
        p3 = packed_once(a, lay, pack)
    assert p2 is p1 and p3 is not p1
    np.testing.assert_array_equal(unpack(p1), np.concatenate([a, b]))
    np.testing.assert_array_equal(unpack(p3), a)
    assert p1.nbytes == 3 * 32 * 8 * 4  # ceil(73 / 32) panels of 8 x 32 fp32
