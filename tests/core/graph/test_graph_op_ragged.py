"""Rows of different lengths in the in-place cache form: a batch whose rows hold
different pasts decodes each row as if it were alone, and prompts of different
lengths go in packed (``q_lens``: a left-padded batch without its padding). Oracle:
the same block run on each row alone, with its own cache (itself checked against the
whole sequence in test_graph_op_kv_in_place). Bad ``q_lens`` leave the cache as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import atbcore as atb
from atbcore.errors import InputError, ShapeError
from atbcore.graph.graph_op_kv import run_in_place
from atbcore.graph.graph_op import GraphOp
from atbcore.memory import KVCache
from oracle import rand
from test_graph_op_kv_in_place import D, H, NH, rope_gqa_block, seed_block

LENS = [3, 7, 5]


def _cache(batch, kv_heads=NH):
    return KVCache(num_layers=1, max_batch=batch, max_seq_len=16, num_kv_heads=kv_heads,
                   head_dim=D, dtype="fp32")


def _alone(op, prompt, steps, kv_heads):
    """Row by row: the prompt, then one token per step, each row with its own cache."""
    cache = _cache(1, kv_heads)
    outs = [op(prompt[None], kv_cache=cache)[0][0]]
    outs += [op(t[None, None], kv_cache=cache)[0][0, 0] for t in steps]
    return outs


@pytest.mark.parametrize("make,kv_heads", [(seed_block, NH), (rope_gqa_block, 2)],
                         ids=["seed", "rope_gqa"])
def test_packed_prompts_then_ragged_decode_equal_each_row_alone(make, kv_heads):
    op = make()
    rows = [torch.from_numpy(rand([n, H], seed=10 + i)) for i, n in enumerate(LENS)]
    steps = torch.from_numpy(rand([3, len(LENS), H], seed=20))  # 3 decode steps
    cache = _cache(len(LENS), kv_heads)
    packed = run_in_place(op, torch.cat(rows), cache, LENS)
    assert packed.shape == (sum(LENS), H)
    assert cache.seq_lens(layer=0).tolist() == LENS
    decoded = [op(steps[t][:, None], kv_cache=cache)[0] for t in range(3)]
    assert cache.seq_lens(layer=0).tolist() == [n + 3 for n in LENS]
    start = 0
    for r, n in enumerate(LENS):
        want = _alone(op, rows[r], steps[:, r], kv_heads)
        atb.assert_close(packed[start:start + n], want[0], "fp32", f"row {r} prompt")
        for t in range(3):
            atb.assert_close(decoded[t][r, 0], want[1 + t], "fp32", f"row {r} step {t}")
        start += n


def test_bad_q_lens_are_refused_and_the_cache_is_untouched():
    op = seed_block()
    cache = _cache(3)
    run_in_place(op, torch.from_numpy(rand([6, H], seed=1)), cache, [2, 3, 1])
    before = cache.seq_lens(layer=0).tolist()
    x = torch.from_numpy(rand([6, H], seed=2))
    with pytest.raises(ShapeError, match="sum of q_lens"):
        run_in_place(op, x, cache, [2, 2, 1])
    with pytest.raises(InputError, match="q_lens"):
        run_in_place(op, x, cache, [6, 0, 0])
    with pytest.raises(InputError, match="max_batch"):
        run_in_place(op, x, cache, [1, 1, 1, 1, 1, 1])
    with pytest.raises(ShapeError, match="max_seq_len 16"):
        run_in_place(op, torch.from_numpy(rand([17, H], seed=3)), cache, [15, 1, 1])
    assert cache.seq_lens(layer=0).tolist() == before
    np.testing.assert_array_equal(cache.seq_lens(layer=0), before)


def test_caller_positions_and_kept_tokens():
    """``positions``: the default slots given explicitly are bit-equal to none given,
    and a per-row shift leaves RoPE attention unchanged (it sees only distances);
    ``keep``: a LastToken block hands back exactly the tokens asked for."""
    from atbcore.graph.layers_block import LastToken

    op = rope_gqa_block()
    head = GraphOp(list(op._layers) + [LastToken()], name="rope_gqa_last")
    x = torch.from_numpy(rand([sum(LENS), H], seed=4))
    slots = np.concatenate([np.arange(n) for n in LENS])
    plain = run_in_place(op, x, _cache(3, 2), LENS)
    same = run_in_place(op, x, _cache(3, 2), LENS, positions=slots)
    assert torch.equal(plain, same)
    shifted = run_in_place(op, x, _cache(3, 2), LENS,
                           positions=slots + np.repeat([5, 0, 9], LENS))
    atb.assert_close(shifted, plain, "fp32", "positions shifted per row")
    keep = np.array([0, 4, 9, 14])
    kept = run_in_place(head, x, _cache(3, 2), LENS, keep=keep)
    assert torch.equal(kept.reshape(len(keep), H), plain[keep])
    last = run_in_place(head, x, _cache(3, 2), LENS)                  # default: each row's last
    assert torch.equal(last.reshape(3, H), plain[np.cumsum(LENS) - 1])
    cache = _cache(3, 2)
    for bad, match in ((dict(positions=slots[:-1]), "positions"),
                       (dict(positions=-slots - 1), "positions"),
                       (dict(keep=[0, 15]), "keep"), (dict(keep=[0.5]), "keep")):
        with pytest.raises(InputError, match=match):
            run_in_place(head, x, cache, LENS, **bad)
    with pytest.raises(InputError, match="LastToken"):
        run_in_place(op, x, _cache(3, 2), LENS, keep=[0])
    assert cache.seq_lens(layer=0).tolist() == [0, 0, 0]


def test_index_tensors_off_the_host_are_updated_where_they_are(monkeypatch):
    """Index tensors that do not share the host arrays' memory (a GPU's) get the new
    step's values copied in, at the same addresses: a captured decode step reads them
    there. Tensors standing in for device ones here: the results are unchanged."""
    import atbcore.graph.graph_op_feed as feed

    op = seed_block()
    steps = torch.from_numpy(rand([3, len(LENS), 1, H], seed=21))
    rows = [torch.from_numpy(rand([n, H], seed=10 + i)) for i, n in enumerate(LENS)]

    def run():
        cache = _cache(len(LENS))
        run_in_place(op, torch.cat(rows), cache, LENS)
        outs, ptrs = [], []
        for t in range(3):
            outs.append(op(steps[t], kv_cache=cache)[0].clone())
            state = feed.cache_state(cache)[1]
            ptrs.append({k: list(s.tensors) for k, s in state.items()})
        return outs, ptrs

    want, _ = run()
    monkeypatch.setattr(feed, "_shares", lambda t, a: False)
    got, ptrs = run()
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    decode_sets = set(ptrs[0]) & set(ptrs[2])
    assert decode_sets and all(a is b for k in decode_sets for a, b in zip(ptrs[0][k], ptrs[2][k]))
