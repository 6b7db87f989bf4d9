"""atb_paddle.compile(layer) of the seed's AcceleratedLLaMA written as a Paddle Layer
(GraphOps + atb.KVCache): ``generate`` equals the same model's uncompiled greedy loop
(the whole sequence recomputed each step), also for a model without a cache; seeded
sampling repeats; bad arguments are refused by name."""

import numpy as np
import pytest

paddle = pytest.importorskip("paddle", reason="paddle is not installed")
import atb_paddle as atb  # noqa: E402
from atbcore.memory import KVCache  # noqa: E402

V, H, L, NH, MLP = 64, 32, 2, 4, 48


class Block(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.attention_graph = atb.GraphOp([
            atb.LayerNorm(eps=1e-5), atb.FlashAttention(num_heads=NH, causal=True, kv_cache=True),
            atb.Linear(out_features=H), atb.ResidualAdd()])
        self.mlp_graph = atb.GraphOp([
            atb.LayerNorm(eps=1e-5), atb.Linear(out_features=MLP), atb.SiLU(),
            atb.Linear(out_features=H), atb.ResidualAdd()])

    def forward(self, x, kv_cache=None):
        x, kv_cache = self.attention_graph(x, kv_cache=kv_cache)
        return self.mlp_graph(x), kv_cache


class AcceleratedLLaMA(paddle.nn.Layer):
    def __init__(self, cached=True):
        super().__init__()
        self.embedding = paddle.nn.Embedding(V, H)
        self.layers = paddle.nn.LayerList([Block() for _ in range(L)])
        self.norm = paddle.nn.LayerNorm(H)
        self.lm_head = paddle.nn.Linear(H, V, bias_attr=False)
        if cached:  # a model without a kv_cache attribute keeps no state between calls
            self.kv_cache = KVCache(L, 2, 40, NH, H // NH, dtype="fp32")

    def forward(self, input_ids):
        x = self.embedding(input_ids)
        for layer in self.layers:
            if not hasattr(self, "kv_cache"):  # the whole sequence each call
                x, _ = layer(x, kv_cache=None)
            else:
                x, self.kv_cache = layer(x, kv_cache=self.kv_cache)
        return self.lm_head(self.norm(x))


def _ids(b, s, seed):
    return paddle.to_tensor(np.random.default_rng(seed).integers(0, V, (b, s)))


def _greedy(model, ids, n):
    seq = ids.numpy()
    with paddle.no_grad():
        for _ in range(n):
            if hasattr(model, "kv_cache"):
                model.kv_cache.reset()
            logits = model(paddle.to_tensor(seq)).numpy()
            seq = np.concatenate([seq, logits[:, -1].argmax(-1)[:, None]], axis=1)
    return seq


@pytest.mark.parametrize("cached", [True, False], ids=["kv_cache", "recompute"])
def test_compiled_generate_equals_the_uncompiled_greedy_loop(cached):
    paddle.seed(0)
    model = AcceleratedLLaMA(cached)
    fast = atb.compile(model, mode="infer", opt_level=2)
    assert len(fast.graph_ops) == 2 * L
    ids = _ids(2, 5, 1)
    out = fast.generate(ids, max_new_tokens=8)
    assert out.numpy().tolist() == _greedy(model, ids, 8).tolist()


def test_seeded_sampling_repeats_and_eos_pads():
    paddle.seed(1)
    fast = atb.compile(AcceleratedLLaMA())
    ids = _ids(2, 4, 2)
    a = fast.generate(ids, max_new_tokens=6, do_sample=True, top_k=8, seed=5).numpy()
    b = fast.generate(ids, max_new_tokens=6, do_sample=True, top_k=8, seed=5).numpy()
    assert a.shape == (2, 10) and (a == b).all() and (a[:, :4] == ids.numpy()).all()
    greedy = fast.generate(ids, max_new_tokens=6).numpy()
    eos = int(greedy[0, 4])  # row 0's first new token: it stops at once, padded with eos
    out = fast.generate(ids, max_new_tokens=6, eos_token_id=eos).numpy()
    assert (out[0, 4:] == eos).all()


def test_bad_compile_and_generate_arguments_are_refused():
    with pytest.raises(atb.CapabilityError, match="mode"):
        atb.compile(AcceleratedLLaMA(), mode="train")
    with pytest.raises(atb.ParamsError, match="opt_level"):
        atb.compile(AcceleratedLLaMA(), opt_level=True)
    with pytest.raises(atb.CapabilityError, match="GraphOps"):
        atb.compile(paddle.nn.Linear(4, 4))
    fast = atb.compile(AcceleratedLLaMA())
    for kw, what in (({"max_new_tokens": 2.0}, "max_new_tokens"), ({"top_p": 1.5}, "top_p"),
                     ({"temperature": -1.0}, "temperature"), ({"top_k": -2}, "top_k")):
        with pytest.raises(atb.ParamsError, match=what):
            fast.generate(_ids(1, 3, 0), **kw)
    with pytest.raises(atb.ParamsError, match="input_ids"):
        fast.generate(paddle.zeros([2, 0], dtype="int64"))
