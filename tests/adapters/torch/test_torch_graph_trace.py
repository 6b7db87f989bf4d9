"""compile() of a GraphOp model decodes each step as ONE core program: the seed's
AcceleratedLLaMA (GraphOps + atb.KVCache) generates the tokens of its plain-PyTorch
twin and of its own call-by-call run, its blocks run once per generate for the
recording, a weight edit rebuilds the program, and a forward that computes outside
its modules keeps the call-by-call path (with the reason)."""

from __future__ import annotations

import torch
import torch.nn as nn
from seed_models import AcceleratedLLaMA, PlainLLaMA, copy_weights

import atb_torch as atb

V, H, LAYERS, HEADS, MLP = 64, 32, 2, 4, 48


def _seed(seed=0):
    torch.manual_seed(seed)
    model = AcceleratedLLaMA(V, H, LAYERS, HEADS, MLP, max_batch=2, max_seq_len=40).eval()
    with torch.no_grad():
        for layer in model.layers:  # materialise the lazy parameters (no cache involved)
            layer(torch.zeros(1, 1, H))
    return model


def _greedy(plain, ids, n):
    seq = ids
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, plain(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq


def test_seed_model_decodes_as_one_program_with_the_plain_models_tokens():
    model = _seed()
    plain = copy_weights(model, PlainLLaMA(V, H, LAYERS, HEADS, MLP))
    fast = atb.compile(model, mode="infer", opt_level=3)
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(1))
    calls = []
    hook = model.layers[0].attention_graph.register_forward_hook(lambda *a: calls.append(1))
    try:
        out = fast.generate(ids, max_new_tokens=12)
    finally:
        hook.remove()
    assert fast._program is not None, fast._program_refused
    assert len(calls) == 2  # the prompt and the recorded first step; then the program
    assert torch.equal(out, _greedy(plain, ids, 12))
    by_call = atb.compile(model, mode="infer", opt_level=1).generate(ids, max_new_tokens=12)
    assert torch.equal(out, by_call)
    # every weight of the program is a tensor the blocks (or modules) already hold: the
    # packed layouts are shared, nothing is copied (merged QKV included)
    op = fast._program.op
    assert set(op._bound) == set(op.graph.weight_map)
    # one program doing the blocks' kernels, plus the embedding, final norm and LM head
    # that ran as torch modules and a one-Linear GraphOp (nothing lost, nothing added)
    form = fast._program.op._in_place
    per_block = sum((g._runner.core._in_place or g._runner.core).last_launches
                    for g in fast.graph_ops)
    assert form.last_launches == per_block + 3, (form.last_launches, per_block)
    text = fast.explain()
    assert "one program" in text and "layers.1.mlp_graph" in text and "lm_head" in text
    assert "PagedAttention -> torch" in text and "(bound once)" in text  # kernels bound


def test_a_weight_edit_rebuilds_the_program():
    model = _seed(2)
    fast = atb.compile(model, mode="infer", opt_level=2)
    ids = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(3))
    fast.generate(ids, max_new_tokens=4)
    first = fast._program
    with torch.no_grad():
        model.layers[1].mlp_graph.layers["linear"].weight.mul_(-1.5)
        model.lm_head.weight.mul_(0.75)
    out = fast.generate(ids, max_new_tokens=10)
    assert fast._program is not first and fast._program is not None
    plain = copy_weights(model, PlainLLaMA(V, H, LAYERS, HEADS, MLP))
    assert torch.equal(out, _greedy(plain, ids, 10))


def test_a_new_cache_or_batch_size_between_generates():
    """A model given a fresh KVCache, or called with another batch size, still
    decodes its own tokens (the program follows the model's cache)."""
    import atbcore

    model = _seed(6)
    plain = copy_weights(model, PlainLLaMA(V, H, LAYERS, HEADS, MLP))
    fast = atb.compile(model, mode="infer", opt_level=3)
    g = torch.Generator().manual_seed(7)
    a, b = torch.randint(0, V, (2, 5), generator=g), torch.randint(0, V, (1, 8), generator=g)
    assert torch.equal(fast.generate(a, max_new_tokens=5), _greedy(plain, a, 5))
    # the compiled model's tree (a shallow copy sharing every module) holds its cache
    fast.model.kv_cache = atbcore.memory.KVCache(LAYERS, 2, 40, HEADS, H // HEADS, dtype="fp32")
    assert torch.equal(fast.generate(b, max_new_tokens=7), _greedy(plain, b, 7))
    assert fast._program is not None and fast._program.cache is fast.model.kv_cache
    assert torch.equal(fast.generate(a, max_new_tokens=4), _greedy(plain, a, 4))


class _Scaled(nn.Module):
    """The seed model with a torch op between its modules."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.kv_cache = inner.kv_cache

    def forward(self, ids):
        m = self.inner
        x = m.embedding(ids) * 1.0
        for layer in m.layers:
            x, m.kv_cache = layer(x, kv_cache=m.kv_cache)
        return m.lm_head(m.norm(x))


def test_a_forward_computing_outside_its_modules_runs_call_by_call():
    model = _seed(4)
    wrapped = _Scaled(model)
    fast = atb.compile(wrapped, mode="infer", opt_level=3)
    ids = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(5))
    out = fast.generate(ids, max_new_tokens=6)
    assert fast._program is None and "outside its modules" in fast._program_refused
    assert "call by call (forward computes outside its modules" in fast.explain()
    plain = copy_weights(model, PlainLLaMA(V, H, LAYERS, HEADS, MLP))
    assert torch.equal(out, _greedy(plain, ids, 6))
