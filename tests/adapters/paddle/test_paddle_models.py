"""Acceptance for atb_paddle: a LLaMA decoder layer and a BERT encoder layer, each
built once as a graph, give the same outputs through torch (the core GraphOp on
torch tensors) and through atb_paddle.GraphOp (Paddle tensors, Paddle kernels), and
match plain Paddle implementations written with Paddle's own layers and the same
weights; the seed's MLP GraphOp example runs as written."""

import numpy as np
import pytest

paddle = pytest.importorskip("paddle", reason="paddlepaddle is not installed")
import paddle.nn.functional as F  # noqa: E402

import atbcore as atb  # noqa: E402
from atbcore.graph import layers as L  # noqa: E402
from atbcore.graph.graph_op import GraphOp as CoreGraphOp  # noqa: E402
from atbcore.graph.sequential import lower_sequential  # noqa: E402
from oracle import rand  # noqa: E402
from paddle_cases import to_paddle  # noqa: E402

import atb_paddle  # noqa: E402

B, S, H, NH, NKV, D, I = 2, 7, 64, 4, 2, 16, 96


def _randomize(graph, seed=0):
    """Every weight random (norm weights too, so a swapped weight cannot pass)."""
    rng = np.random.default_rng(seed)
    ws = []
    for tid, w in graph.weights:
        a = np.asarray(w)
        if tid.endswith("norm.weight") or tid.startswith("ln"):
            a = (1.0 + 0.3 * rng.standard_normal(a.shape)).astype(np.float32)
        ws.append((tid, a))
    return graph.replace(weights=tuple(ws))


def _plinear(w, b=None):
    """paddle.nn.Linear holding W [out, in] (Paddle stores [in, out])."""
    lin = paddle.nn.Linear(w.shape[1], w.shape[0], bias_attr=b is not None)
    lin.weight.set_value(paddle.to_tensor(np.ascontiguousarray(w.T)))
    if b is not None:
        lin.bias.set_value(paddle.to_tensor(b))
    return lin


def _attention(q, k, v, causal):
    """Softmax attention by hand: q [B, S, NH, D], k/v [B, S, NKV, D]."""
    g = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose([0, 2, 1, 3]) for t in (q, k, v))            # [B, N, S, D]
    k, v = (paddle.repeat_interleave(t, g, axis=1) for t in (k, v))
    s = paddle.matmul(q, k, transpose_y=True) / float(np.sqrt(q.shape[-1]))
    if causal:
        n = s.shape[-1]
        s = s + paddle.triu(paddle.full([n, n], float("-inf")), diagonal=1)
    o = paddle.matmul(F.softmax(s, axis=-1), v)                          # [B, N, S, D]
    return o.transpose([0, 2, 1, 3]).reshape([q.shape[0], q.shape[2], -1])


def _rope(x, base=10000.0):
    """HF rotate_half RoPE of x [B, S, N, D] at positions 0..S-1."""
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.arange(x.shape[1], dtype=np.float64)[:, None] * inv[None]
    emb = np.concatenate([ang, ang], -1)
    cos = paddle.to_tensor(np.cos(emb).astype(np.float32)).reshape([1, x.shape[1], 1, d])
    sin = paddle.to_tensor(np.sin(emb).astype(np.float32)).reshape([1, x.shape[1], 1, d])
    rot = paddle.concat([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * cos + rot * sin


def _rms(x, w, eps):
    return x * paddle.rsqrt((x * x).mean(axis=-1, keepdim=True) + eps) * w


def plain_paddle_llama(x, W, eps=1e-6):
    t = lambda k: paddle.to_tensor(W[k])  # noqa: E731
    h = _rms(x, t("attn_norm.weight"), eps)
    q = _plinear(W["attn.q_proj.weight"])(h).reshape([B, S, NH, D])
    k = _plinear(W["attn.k_proj.weight"])(h).reshape([B, S, NKV, D])
    v = _plinear(W["attn.v_proj.weight"])(h).reshape([B, S, NKV, D])
    a = _attention(_rope(q), _rope(k), v, causal=True)
    h1 = x + _plinear(W["o_proj.weight"])(a)
    m = _rms(h1, t("mlp_norm.weight"), eps)
    gate, up = _plinear(W["mlp.gate_proj.weight"])(m), _plinear(W["mlp.up_proj.weight"])(m)
    return h1 + _plinear(W["mlp.down_proj.weight"])(F.silu(gate) * up)


def plain_paddle_bert(x, W, eps=1e-12):
    def ln(h, name):
        m = paddle.nn.LayerNorm(H, epsilon=eps)
        m.weight.set_value(paddle.to_tensor(W[f"{name}.weight"]))
        m.bias.set_value(paddle.to_tensor(W[f"{name}.bias"]))
        return m(h)

    lin = lambda n: _plinear(W[f"{n}.weight"], W[f"{n}.bias"])  # noqa: E731
    q, k, v = (lin(f"attn.{p}_proj")(x).reshape([B, S, NH, D]) for p in "qkv")
    h = ln(x + lin("attn_out")(_attention(q, k, v, causal=False)), "ln1")
    f = lin("ffn.down_proj")(F.gelu(lin("ffn.up_proj")(h)))
    return ln(h + f, "ln2")


def llama_layers():
    return [L.RmsNorm("attn_norm", eps=1e-6), L.RoPE(num_heads=NH, head_dim=D),
            L.FlashAttention("attn", num_heads=NH, num_kv_heads=NKV, causal=True),
            L.Linear("o_proj", out_features=H, bias=False), L.ResidualAdd("h1"),
            L.RmsNorm("mlp_norm", eps=1e-6), L.FusedFeedForward("mlp", intermediate_size=I),
            L.ResidualAdd("out", residual="h1")]


def bert_layers():
    return [L.FlashAttention("attn", num_heads=NH, qkv_bias=True),
            L.Linear("attn_out", out_features=H), L.ResidualAdd("h0"), L.LayerNorm("ln1", eps=1e-12),
            L.FusedFeedForward("ffn", intermediate_size=I, activation_type="gelu", bias=True),
            L.ResidualAdd("h2", residual="ln1"), L.LayerNorm("ln2", eps=1e-12)]


@pytest.mark.parametrize("model", ["llama", "bert"])
def test_model_layer_same_in_torch_paddle_and_plain_paddle(model):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    layers, plain = (llama_layers(), plain_paddle_llama) if model == "llama" else \
        (bert_layers(), plain_paddle_bert)
    graph = _randomize(lower_sequential(layers, [atb.TensorDesc([B, S, H])], model))  # built once
    W = {k: np.asarray(v) for k, v in graph.weights}
    x = rand((B, S, H), "fp32", 7)

    y_torch = CoreGraphOp(graph)(torch.from_numpy(x.copy()))
    pblock = atb_paddle.GraphOp(graph)
    y_paddle = pblock(to_paddle(x))
    assert isinstance(y_paddle, paddle.Tensor) and isinstance(y_torch, torch.Tensor)
    backends = {c.backend for c in pblock.core.last_plan.calls}
    assert backends == {"paddle"}, pblock.explain()           # Paddle kernels throughout
    y_plain = plain(paddle.to_tensor(x), W)

    atb.assert_close(y_paddle, y_torch, "fp32", f"{model}: atb_paddle vs torch")
    atb.assert_close(y_paddle, y_plain, "fp32", f"{model}: atb_paddle vs plain Paddle")
    atb.assert_close(y_torch, y_plain.numpy(), "fp32", f"{model}: torch vs plain Paddle")
    # the graph's weights are the GraphOp's Paddle parameters, under the graph ids
    sd = pblock.state_dict()
    assert sorted(sd) == sorted(W)
    np.testing.assert_array_equal(sd["attn.q_proj.weight"].numpy(), W["attn.q_proj.weight"])


def test_seed_mlp_example_runs_as_written():
    atb = atb_paddle
    hidden_dim, mlp_dim = 64, 256
    mlp_graph = atb.GraphOp([
        atb.LayerNorm(eps=1e-5),
        atb.Linear(out_features=mlp_dim),
        atb.SiLU(),                    # SwiGLU激活
        atb.Linear(out_features=hidden_dim),
        atb.ResidualAdd()
    ])
    x = paddle.randn([2, 16, hidden_dim])
    y = mlp_graph(x)
    assert isinstance(y, paddle.Tensor) and y.shape == x.shape
    sd = mlp_graph.state_dict()
    ln = paddle.nn.LayerNorm(hidden_dim, epsilon=1e-5)
    ln.set_state_dict({"weight": sd["0.weight"], "bias": sd["0.bias"]})
    fc1 = _plinear(sd["1.weight"].numpy(), sd["1.bias"].numpy())
    fc2 = _plinear(sd["3.weight"].numpy(), sd["3.bias"].numpy())
    ref = x + fc2(F.silu(fc1(ln(x))))
    atb_core = atb_paddle  # the same checker the core exports
    atb_core.assert_close(y, ref, "fp32", "seed MLP vs plain Paddle")
    assert "FusedFeedForward" in mlp_graph.explain()           # fused, on Paddle kernels


class AcceleratedTransformerBlock(paddle.nn.Layer):
    """The seed article's block, in Paddle (atb_torch -> atb_paddle, nn.Module -> Layer)."""

    def __init__(self, hidden_dim, num_heads, mlp_dim):
        super().__init__()
        atb = atb_paddle
        self.attention_graph = atb.GraphOp([
            atb.LayerNorm(eps=1e-5),
            atb.FlashAttention(num_heads=num_heads,
                               causal=True,
                               kv_cache=True),
            atb.Linear(out_features=hidden_dim),
            atb.ResidualAdd()
        ])
        self.mlp_graph = atb.GraphOp([
            atb.LayerNorm(eps=1e-5),
            atb.Linear(out_features=mlp_dim),
            atb.SiLU(),
            atb.Linear(out_features=hidden_dim),
            atb.ResidualAdd()
        ])

    def forward(self, x, kv_cache=None):
        x, kv_cache = self.attention_graph(x, kv_cache=kv_cache)
        x = self.mlp_graph(x)
        return x, kv_cache


def test_seed_transformer_block_decodes_with_its_kv_cache():
    blk = AcceleratedTransformerBlock(64, 4, 128)
    x = to_paddle(rand((2, 6, 64), "fp32", 1))
    full, _ = blk(x)
    pre, kv = blk(x[:, :5])                                   # prefill 5 tokens
    step, kv = blk(x[:, 5:], kv_cache=kv)                     # decode the 6th from the cache
    atb.assert_close(pre, full[:, :5], "fp32", "prefill vs full")
    atb.assert_close(step, full[:, 5:], "fp32", "decode with KV cache vs full")
    # weights (incl. the fused q|k|v copy the graph derived) follow set_state_dict
    other = AcceleratedTransformerBlock(64, 4, 128)
    for name, p in other.named_parameters():
        p.set_value(p * 0.5 + 0.1)                            # different weights
    other(x)
    other.set_state_dict(blk.state_dict())
    np.testing.assert_array_equal(other(x)[0].numpy(), full.numpy())
