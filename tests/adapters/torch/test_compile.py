"""torch.compile(fullgraph=True) over a small model built only from atb_torch modules
(standalone ops and GraphOps, KV cache in the dict form): no graph breaks
(torch._dynamo.explain), one graph, outputs equal to eager. One compile only: compiles
are slow on this machine."""

import pytest
import torch
from torch import nn

import atb_torch as atb

H, HEADS, VOCAB = 32, 4, 50


class TinyAtbLM(nn.Module):
    """Embedding -> [RmsNorm, RoPE, FlashAttention(kv_cache), Linear, ResidualAdd] ->
    [RmsNorm, FusedFeedForward, ResidualAdd] -> RmsNorm -> Linear head."""

    def __init__(self):
        super().__init__()
        self.embed = atb.Embedding(VOCAB, H)
        self.attn = atb.GraphOp([atb.RmsNorm(H), atb.RoPE(num_heads=HEADS),
                                 atb.FlashAttention(num_heads=HEADS, num_kv_heads=2, causal=True,
                                                    kv_cache=True, hidden_size=H),
                                 atb.Linear(H, H, bias=False), atb.ResidualAdd()], name="attn")
        self.mlp = atb.GraphOp([atb.RmsNorm(H), atb.FusedFeedForward(intermediate_size=64,
                                                                     hidden_size=H),
                                atb.ResidualAdd()], name="mlp")
        self.norm = atb.RmsNorm(H)
        self.head = atb.Linear(H, VOCAB, bias=False)

    def forward(self, ids, kv=None):
        x = self.embed(ids)
        x, kv = self.attn(x, kv_cache=kv)
        x = self.mlp(x)
        return self.head(self.norm(x)), kv


def test_compile_fullgraph_without_graph_breaks_equals_eager():
    torch.manual_seed(0)
    model = TinyAtbLM().eval()
    ids = torch.randint(0, VOCAB, (2, 6))
    with torch.no_grad():
        want, kv = model(ids)
        want_step, _ = model(ids[:, :1], dict(kv))
        torch._dynamo.reset()
        ex = torch._dynamo.explain(model)(ids)
        assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons
        names = [str(n.target) for g in ex.graphs for n in g.graph.nodes]
        assert sum("atb.graph_op" in n for n in names) == 2  # one custom op per GraphOp
        ex = torch._dynamo.explain(model)(ids[:, :1], dict(kv))  # cached decode traces too
        assert ex.graph_break_count == 0, ex.break_reasons
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        got, got_kv = compiled(ids)
    atb.assert_close(got, want, "fp32", "compiled vs eager logits")
    (k, v), = next(iter(got_kv.values()))
    (k0, v0), = next(iter(kv.values()))
    assert torch.equal(k, k0) and torch.equal(v, v0)
    with torch.no_grad():
        step, _ = model(ids[:, :1], got_kv)  # the compiled run's cache continues eagerly
    atb.assert_close(step, want_step, "fp32", "decode after the compiled prefill")


def test_compiled_with_grad_on_forward_works_backward_raises_atb_error():
    """Parameters require grad (nn defaults) and no torch.no_grad(): the compiled
    forward runs, and backward raises AtbError instead of a silent zero gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(atb.RmsNorm(8), atb.GraphOp([atb.Linear(8, 8), atb.SiLU()]),
                          atb.Linear(8, 4))
    x = torch.randn(2, 8)
    with torch.no_grad():
        model(x)
        want = model(x)
    torch._dynamo.reset()
    y = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    assert y.requires_grad
    atb.assert_close(y.detach(), want, "fp32", "compiled with grad on")
    with pytest.raises(atb.AtbError, match="inference-only"):
        y.sum().backward()
    assert all(p.grad is None for p in model.parameters())


def test_atb_kv_cache_object_is_refused_under_compile_with_a_clear_error():
    g = atb.GraphOp([atb.FlashAttention(num_heads=2, kv_cache=True, hidden_size=8)], name="a")
    cache = atb.KVCache(1, 1, 8, 2, 4, dtype=torch.float32)
    x = torch.randn(1, 2, 8)

    def step(x):
        return g(x, kv_cache=cache)[0]

    with torch.no_grad(), pytest.raises(Exception, match="KVCache under torch.compile"):
        torch._dynamo.reset()
        torch.compile(step, fullgraph=True, backend="eager")(x)
