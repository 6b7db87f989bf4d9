"""A decoder lowered for tensor parallelism (Megatron sharding on the core GraphOp)
on 2 real gloo processes: logits against Hugging Face within fp32 tolerance, greedy
tokens identical to the single-process lowering, and each rank holding <= 0.6x of
the weight bytes. Llama (each rank reading only its slices of a safetensors
checkpoint) and Qwen2 (from the in-memory model), KV heads split; Qwen2 with 1 KV
head (replicated on both ranks) and a vocab that does not split evenly (padded);
Mixtral with every expert split over the ranks, read from safetensors."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

import atb_torch as atb
from atb_torch.models.lower import lower_decoder
from atb_torch.models.lower_tp import lower_decoder_tp, shard_plan
from atbcore.distributed import ShardPlan
from atbcore.errors import CapabilityError
from tiny_models import VOCAB, tiny

sys.path.insert(0, os.path.dirname(__file__))
from dist_ranks import run_ranks  # noqa: E402
from tp_workers import cache_for, decode, graph_weight_bytes, run_model  # noqa: E402

WORLD, PROMPT, GREEDY = 2, 6, 8
IDS = torch.randint(3, 250, (2, 10), generator=torch.Generator().manual_seed(5)).numpy()
CASES = {
    "llama-from-safetensors-shards": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen2-1kv-odd-vocab": ("qwen2", {"num_key_value_heads": 1, "vocab_size": VOCAB - 5}),
    # every expert's gate/up rows and down columns split, read per expert from the files
    "mixtral-experts-split-from-safetensors": ("mixtral", {}),
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    cases = []
    for name, (arch, over) in CASES.items():
        checkpoint = None
        if "safetensors" in name:  # each rank reads its slices of a seeded checkpoint
            checkpoint = str(tmp_path_factory.mktemp("ckpt"))
            tiny(arch, **over).save_pretrained(checkpoint, safe_serialization=True)
        cases.append((arch, over, IDS, PROMPT, GREEDY, checkpoint))
    got = run_ranks(run_model, (cases,), world=WORLD, timeout=240)
    return {name: [got[r][i] for r in range(WORLD)] for i, name in enumerate(CASES)}


@pytest.mark.parametrize("name", list(CASES))
def test_tp2_logits_tokens_and_bytes(ranks, name):
    arch, over = CASES[name]
    hf = tiny(arch, **over)
    ids = torch.as_tensor(IDS)
    with torch.no_grad():
        want = hf(ids).logits
    single = lower_decoder(hf)
    plan1 = shard_plan(hf.config)  # no process group here: one rank holding everything
    _, greedy1 = decode(single, cache_for(hf.config, plan1, 1), ids[:1, :PROMPT], GREEDY)
    full_bytes = graph_weight_bytes(single)
    for r, got in enumerate(ranks[name]):
        atb.assert_close(torch.as_tensor(got["logits"]), want, "fp32", f"{name} rank {r} vs HF")
        assert np.array_equal(got["greedy"], greedy1.numpy()), (name, r)
        assert got["bytes"] <= 0.6 * full_bytes, (name, r, got["bytes"], full_bytes)
    layers = hf.config.num_hidden_layers
    for got in ranks[name]:  # Megatron: two all-reduces per layer, vocab-parallel ends
        ops = got["ops"]
        assert ops.count("LinearParallel") == layers and ops.count("AllReduce") == layers, ops
        assert ops.count("VocabParallelEmbedding") == 1 and ops.count("AllGather") == 1, ops
        assert "Embedding" not in ops
        assert ops.count("MoE") == (layers if arch == "mixtral" else 0), ops
    # both ranks compute the same logits (they all-gather one result)
    np.testing.assert_array_equal(ranks[name][0]["logits"], ranks[name][1]["logits"])
    kv = hf.config.num_key_value_heads
    rows = [got["kv_rows"] for got in ranks[name]]
    if kv < WORLD:   # replicated: both ranks keep the one KV head
        assert [got["kv_heads"] for got in ranks[name]] == [1, 1] and rows[0] == rows[1]
    else:            # split: disjoint halves
        assert rows == [(0, 16 * kv // 2), (16 * kv // 2, 16 * kv)]


def test_sharding_refuses_what_does_not_split():
    geo = dict(hidden_size=64, head_dim=16, intermediate_size=128, vocab_size=256)
    with pytest.raises(CapabilityError, match="KV heads"):
        ShardPlan(rank=0, world=4, num_heads=12, num_kv_heads=3, **geo)
    with pytest.raises(CapabilityError, match="attention heads"):
        ShardPlan(rank=0, world=2, num_heads=3, num_kv_heads=1, **geo)
    with pytest.raises(atb.ParamsError, match="rank"):
        ShardPlan(rank=2, world=2, num_heads=4, num_kv_heads=2, **geo)


def test_one_process_tp_graph_equals_hugging_face():
    """Without a process group the same sharded graph is its one-rank case (every
    collective local): the logits still match HF, and Mistral's windows pass through."""
    hf = tiny("mistral")
    op = lower_decoder_tp(hf)
    ids = torch.as_tensor(IDS)
    plan = shard_plan(hf.config)
    logits, _ = decode(op, cache_for(hf.config, plan, 2), ids[:, :PROMPT], ids.shape[1] - PROMPT,
                       feed=ids[:, PROMPT:])
    with torch.no_grad():
        atb.assert_close(logits, hf(ids).logits, "fp32", "one-rank TP graph vs HF")


def test_refusals_name_what_is_wrong():
    with pytest.raises(CapabilityError, match="tensor_parallel 2.*group of 1"):
        lower_decoder_tp(tiny("llama"), tensor_parallel=2)
    with pytest.raises(CapabilityError, match="q/k norms"):
        lower_decoder_tp(tiny("qwen3"))
    with pytest.raises(CapabilityError, match="LayerNorm blocks; learned positions"):
        lower_decoder_tp(tiny("gpt2"))
    with pytest.raises(CapabilityError, match="MLP biases"):
        lower_decoder_tp(tiny("llama", mlp_bias=True))
