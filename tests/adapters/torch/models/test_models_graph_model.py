"""compile() of the seed's AcceleratedLLaMA, a model built from atb GraphOps: forward
unchanged, incremental ``generate`` equal to recomputing the whole sequence."""

import pytest
import torch
import torch.nn as nn

import atb_torch as atb
from atb_torch.models import compile
from atb_torch.models.graph_model import CompiledGraphModel


class AcceleratedTransformerBlock(nn.Module):
    """The seed article's block, as written there."""

    def __init__(self, hidden_dim, num_heads, mlp_dim):
        super().__init__()
        self.attention_graph = atb.GraphOp([
            atb.LayerNorm(eps=1e-5),
            atb.FlashAttention(num_heads=num_heads, causal=True, kv_cache=True),
            atb.Linear(out_features=hidden_dim),
            atb.ResidualAdd()])
        self.mlp_graph = atb.GraphOp([
            atb.LayerNorm(eps=1e-5),
            atb.Linear(out_features=mlp_dim),
            atb.SiLU(),
            atb.Linear(out_features=hidden_dim),
            atb.ResidualAdd()])

    def forward(self, x, kv_cache=None):
        x, kv_cache = self.attention_graph(x, kv_cache=kv_cache)
        x = self.mlp_graph(x)
        return x, kv_cache


class AcceleratedLLaMA(nn.Module):
    def __init__(self, vocab_size, hidden_dim, num_layers, num_heads, mlp_dim):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, hidden_dim)
        self.layers = nn.ModuleList([AcceleratedTransformerBlock(hidden_dim, num_heads, mlp_dim)
                                     for _ in range(num_layers)])
        self.norm = nn.LayerNorm(hidden_dim)
        self.lm_head = nn.Linear(hidden_dim, vocab_size, bias=False)
        self.kv_cache = None

    def forward(self, input_ids):
        x = self.embedding(input_ids)
        for layer in self.layers:
            x, self.kv_cache = layer(x, kv_cache=self.kv_cache)
        x = self.norm(x)
        return self.lm_head(x)


@pytest.fixture(scope="module")
def seed_model():
    torch.manual_seed(0)
    return AcceleratedLLaMA(vocab_size=128, hidden_dim=64, num_layers=2, num_heads=4, mlp_dim=128)


def _full(model, seq):
    model.kv_cache = None  # no state: the whole sequence is recomputed
    with torch.no_grad():
        return model(seq)


def test_seed_model_compiles_and_generates(seed_model):
    fast = compile(seed_model, mode="infer", opt_level=3, enable_prefix_caching=True,
                   enable_speculative=False)
    assert isinstance(fast, CompiledGraphModel) and len(fast.graph_ops) == 4
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(1))
    ref = _full(seed_model, ids)
    seed_model.kv_cache = None
    atb.assert_close(fast(ids), ref, "fp32", "compiled seed model vs the model")
    out = fast.generate(ids, max_new_tokens=12)
    seq = ids
    for _ in range(12):  # greedy by recomputing everything each step
        seq = torch.cat([seq, _full(seed_model, seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


def test_seed_model_seeded_sampling(seed_model):
    fast = compile(seed_model)
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(2))
    a = fast.generate(ids, max_new_tokens=8, do_sample=True, top_k=10, seed=7)
    b = fast.generate(ids, max_new_tokens=8, do_sample=True, top_k=10, seed=7)
    c = fast.generate(ids, max_new_tokens=8, do_sample=True, top_k=10, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.shape == (2, 13)


def test_compile_runs_the_plain_lm_head_as_a_graph_op_on_the_same_weight(seed_model):
    fast = compile(seed_model)
    assert fast.lowered_linears == 1
    head = fast.model.lm_head
    assert isinstance(head, atb.GraphOp) and type(seed_model.lm_head) is nn.Linear  # untouched
    (lin,) = head.layers.values()
    assert lin.weight is seed_model.lm_head.weight  # shared, not copied
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        atb.assert_close(head(x), seed_model.lm_head(x), "fp32", "lowered LM head vs nn.Linear")
        seed_model.lm_head.weight.mul_(0.5)  # an in-place edit is seen by the compiled model
        try:
            atb.assert_close(head(x), seed_model.lm_head(x), "fp32", "after an in-place edit")
        finally:
            seed_model.lm_head.weight.mul_(2.0)
    assert compile(seed_model, opt_level=0).lowered_linears == 0
