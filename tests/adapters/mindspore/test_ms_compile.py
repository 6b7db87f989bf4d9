"""atb_mindspore.compile(cell) of the seed's AcceleratedLLaMA written as a MindSpore
Cell (GraphOps + atb.KVCache): ``generate`` equals the same model's uncompiled greedy
loop (the whole sequence recomputed each step); seeded sampling repeats; a compiled
model's forward in GRAPH_MODE equals PyNative; bad arguments are refused by name."""

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="mindspore is not installed")
import atb_mindspore as atb  # noqa: E402
from atbcore.memory import KVCache  # noqa: E402
from mindspore import nn  # noqa: E402

V, H, L, NH, MLP = 64, 32, 2, 4, 48


class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.attention_graph = atb.GraphOp([
            atb.LayerNorm(eps=1e-5), atb.FlashAttention(num_heads=NH, causal=True, kv_cache=True),
            atb.Linear(out_features=H), atb.ResidualAdd()])
        self.mlp_graph = atb.GraphOp([
            atb.LayerNorm(eps=1e-5), atb.Linear(out_features=MLP), atb.SiLU(),
            atb.Linear(out_features=H), atb.ResidualAdd()])

    def construct(self, x, kv_cache=None):
        x, kv_cache = self.attention_graph(x, kv_cache=kv_cache)
        return self.mlp_graph(x), kv_cache


class AcceleratedLLaMA(nn.Cell):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(V, H)
        self.layers = nn.CellList([Block() for _ in range(L)])
        self.norm = nn.LayerNorm((H,))
        self.lm_head = nn.Dense(H, V, has_bias=False)
        self.kv_cache = KVCache(L, 2, 40, NH, H // NH, dtype="fp32")

    def construct(self, input_ids):
        x = self.embedding(input_ids)
        for layer in self.layers:
            x, self.kv_cache = layer(x, kv_cache=self.kv_cache)
        return self.lm_head(self.norm(x))


def _ids(b, s, seed):
    return ms.Tensor(np.random.default_rng(seed).integers(0, V, (b, s)).astype(np.int64))


def test_compiled_generate_equals_the_uncompiled_greedy_loop():
    ms.set_seed(0)
    model = AcceleratedLLaMA()
    fast = atb.compile(model, mode="infer", opt_level=3)
    assert len(fast.graph_ops) == 2 * L
    ids = _ids(2, 5, 1)
    out = fast.generate(ids, max_new_tokens=8)
    seq = ids.asnumpy()
    for _ in range(8):  # uncompiled: the whole sequence again each step
        model.kv_cache.reset()
        logits = model(ms.Tensor(seq)).asnumpy()
        seq = np.concatenate([seq, logits[:, -1].argmax(-1)[:, None]], axis=1)
    assert out.asnumpy().tolist() == seq.tolist()
    a = fast.generate(ids, max_new_tokens=5, do_sample=True, top_k=8, seed=3).asnumpy()
    b = fast.generate(ids, max_new_tokens=5, do_sample=True, top_k=8, seed=3).asnumpy()
    assert a.shape == (2, 10) and (a == b).all() and (a[:, :5] == ids.asnumpy()).all()


class _Net(nn.Cell):
    """GraphOps without a cache: one forward compiles under GRAPH_MODE."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(V, H)
        self.block = atb.GraphOp([atb.LayerNorm(eps=1e-5), atb.FlashAttention(
            num_heads=NH, causal=True), atb.Linear(out_features=H), atb.ResidualAdd()])
        self.lm_head = nn.Dense(H, V, has_bias=False)

    def construct(self, ids):
        return self.lm_head(self.block(self.embedding(ids)))


def test_a_compiled_forward_in_graph_mode_equals_pynative(graph_mode):
    graph_mode.set_context(mode=graph_mode.PYNATIVE_MODE)
    ms.set_seed(1)
    fast = atb.compile(_Net())
    ids = ms.Tensor(np.random.default_rng(2).integers(0, V, (2, 5)).astype(np.int32))
    eager = fast(ids).asnumpy()
    graph_mode.set_context(mode=graph_mode.GRAPH_MODE)
    graph = fast(ids).asnumpy()
    atb.assert_close(graph, eager, "fp32", "GRAPH_MODE vs PyNative")
    with pytest.raises(atb.CapabilityError, match="PYNATIVE_MODE"):
        fast.generate(ids, max_new_tokens=2)


def test_bad_compile_and_generate_arguments_are_refused():
    with pytest.raises(atb.CapabilityError, match="mode"):
        atb.compile(_Net(), mode="train")
    with pytest.raises(atb.ParamsError, match="opt_level"):
        atb.compile(_Net(), opt_level=7)
    with pytest.raises(atb.CapabilityError, match="GraphOps"):
        atb.compile(nn.Dense(4, 4))
    fast = atb.compile(_Net())
    for kw, what in (({"max_new_tokens": -1}, "max_new_tokens"), ({"top_p": 0.0}, "top_p"),
                     ({"temperature": 0}, "temperature"), ({"top_k": 1.5}, "top_k")):
        with pytest.raises(atb.ParamsError, match=what):
            fast.generate(_ids(1, 3, 0), **kw)
    with pytest.raises(atb.ParamsError, match="input_ids"):
        fast.generate(ms.Tensor(np.zeros((3,), np.float32)))
