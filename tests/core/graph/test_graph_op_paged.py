"""The core lowered decoder over a real paged cache (``run_paged``): packed new tokens
of several sequences (whole prompts, prefill chunks mixed with decode tokens, drafts
verified with every token's logits), keys/values written at the block manager's
slots (block size 16, blocks not contiguous), PagedAttention over the block tables.
Oracle: Hugging Face's logits of each whole sequence (Llama, Qwen2 with biases,
Mistral with an 8-token window), and its greedy choice at every generated position."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import atbcore as atb
from atbcore.errors import InputError, ShapeError
from atbcore.graph.graph_op import GraphOp
from atbcore.graph.graph_op_kv import run_paged
from atbcore.memory import PagedKVCache
from atbcore.models.arch import resolve_architecture
from atbcore.models.checkpoint import load_config, load_tensors, weights_from_tensors
from atbcore.models.decoder import decoder_layers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "adapters" / "torch" / "llm"))
from llm_checkpoint import build_checkpoint  # noqa: E402

BS = 16
LENS = {"a": 20, "b": 5, "c": 37}
CHUNKS = (12, 9)  # sequence d's prompt, in two chunks mixed with decode steps


def _model(tmp_path, arch):
    path = build_checkpoint(tmp_path / arch, arch=arch)
    cfg = load_config(path)
    spec = resolve_architecture(cfg).describe(cfg)
    w = weights_from_tensors(spec, load_tensors(path), cfg, "test")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    return spec, GraphOp(decoder_layers(spec, w, last_token=True), name=arch), hf


def _cache(spec, blocks=40):
    cache = PagedKVCache(spec.num_layers, blocks, BS, spec.num_kv_heads, spec.head_dim,
                         dtype="fp32")
    # every block held, every other one given back: the sequences get scattered blocks
    for i in range(blocks):
        cache.add_sequence(f"hole{i}", num_tokens=BS)
    for i in range(0, blocks, 2):
        cache.free_sequence(f"hole{i}")
    return cache


def _hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def _contiguous(cache, seq):
    t = cache.manager.block_table(seq)
    return list(t) == list(range(t[0], t[0] + len(t)))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_packed_prefill_chunks_and_decode_equal_hugging_face(tmp_path, arch):
    spec, op, hf = _model(tmp_path, arch)
    cache = _cache(spec)
    rng = np.random.default_rng(1)
    seqs = {s: rng.integers(3, spec.vocab_size, n).tolist() for s, n in LENS.items()}
    d_prompt = rng.integers(3, spec.vocab_size, sum(CHUNKS)).tolist()
    got: dict[str, list] = {s: [] for s in [*seqs, "d"]}  # (position, logits row)

    batch = cache.prepare_prefill(list(seqs), list(seqs.values()))
    out = run_paged(op, torch.tensor(sum(seqs.values(), [])), cache, batch)
    assert out.shape == (3, spec.vocab_size)
    for i, s in enumerate(seqs):
        got[s].append((len(seqs[s]) - 1, out[i]))
        seqs[s].append(int(out[i].argmax()))

    pending = list(CHUNKS)
    for _ in range(10):  # 2 mixed steps (a chunk of d + one token each), then decode
        order, ids, starts = list(seqs), [], []
        for s in seqs:
            starts.append(len(seqs[s]) - 1)
            cache.append_tokens(s, 1)
            ids.append(seqs[s][-1])
        chunk_row = None
        if pending:
            n, done = pending.pop(0), sum(CHUNKS[:len(CHUNKS) - len(pending) - 1])
            if done == 0:
                cache.add_sequence("d", num_tokens=n)
            else:
                cache.append_tokens("d", n)
            chunk_row = len(order)
            order.append("d")
            starts.append(done)
            ids += d_prompt[done:done + n]
        out = run_paged(op, torch.tensor(ids), cache, cache.batch_for(order, starts))
        assert out.shape == (len(order), spec.vocab_size)
        for i, s in enumerate(order):
            if i == chunk_row:  # d's prompt: a token is chosen after its last chunk
                if not pending:
                    got["d"].append((len(d_prompt) - 1, out[i]))
                    seqs["d"] = d_prompt + [int(out[i].argmax())]
                continue
            got[s].append((len(seqs[s]) - 1, out[i]))
            seqs[s].append(int(out[i].argmax()))
    multi = [s for s in seqs if len(cache.manager.block_table(s)) > 1]
    assert len(multi) == 3 and not any(_contiguous(cache, s) for s in multi)  # tables jump
    for s, rows in got.items():
        ref = _hf_logits(hf, seqs[s])
        for pos, row in rows:
            atb.assert_close(row, ref[pos], "fp32", f"{arch} sequence {s} position {pos}")
        # greedy: every token chosen here is Hugging Face's argmax at that position
        first = rows[0][0]
        assert seqs[s][first + 1:] == ref[first:-1].argmax(-1).tolist(), s


def test_all_logits_verify_drafts_and_bad_batches_leave_the_cache(tmp_path):
    spec, op, hf = _model(tmp_path, "llama")
    cache = _cache(spec)
    rng = np.random.default_rng(2)
    a, b = (rng.integers(3, spec.vocab_size, n).tolist() for n in (30, 7))
    run_paged(op, torch.tensor(a + b), cache, cache.prepare_prefill(["a", "b"], [a, b]))
    draft = rng.integers(3, spec.vocab_size, 4).tolist()  # a: 4 drafted tokens, b: 1
    cache.append_tokens("a", 4)
    cache.append_tokens("b", 1)
    batch = cache.batch_for(["a", "b"], [30, 7])
    out = run_paged(op, torch.tensor(draft + [5]), cache, batch, all_logits=True)
    assert out.shape == (5, spec.vocab_size)
    atb.assert_close(out[:4], _hf_logits(hf, a + draft)[30:], "fp32", "drafted rows of a")
    atb.assert_close(out[4], _hf_logits(hf, b + [5])[7], "fp32", "b's token")
    # the same step shape again, last tokens only: the rows all_logits gave last
    again = run_paged(op, torch.tensor(draft + [5]), cache, batch)
    atb.assert_close(again, out[[3, 4]], "fp32", "last rows")

    before = [cache.key_cache(0).clone(), cache.value_cache(0).clone()]
    with pytest.raises(ShapeError, match="sum of q_seq_lens"):
        run_paged(op, torch.tensor(draft), cache, batch)
    bad = cache.batch_for(["a", "b"], [30, 7])
    bad.block_tables = torch.full_like(bad.block_tables, cache.num_blocks)
    with pytest.raises(InputError, match="block_tables"):
        run_paged(op, torch.tensor(draft + [5]), cache, bad)
    bad = cache.batch_for(["a", "b"], [30, 7])
    bad.q_seq_lens = torch.tensor([5, 0], dtype=torch.int32)
    with pytest.raises(InputError, match="q_seq_lens"):
        run_paged(op, torch.tensor(draft + [5]), cache, bad)
    assert torch.equal(cache.key_cache(0), before[0])
    assert torch.equal(cache.value_cache(0), before[1])
