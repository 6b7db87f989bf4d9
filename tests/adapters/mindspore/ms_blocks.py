"""A LLaMA decoder layer and a BERT encoder layer, each built once as a core Graph
(``GraphBuilder``), and the same layers written in plain MindSpore (``nn.Dense``,
``nn.LayerNorm``, attention by hand) as the independent oracle."""

from __future__ import annotations


import numpy as np
from mindspore import Tensor, nn, ops

from atbcore.dtypes import Dtype
from atbcore.graph.builder import GraphBuilder
from atbcore.graph.ir import Graph
from atbcore.tensor import TensorDesc

LLAMA = dict(batch=2, seq=7, hidden=32, heads=4, kv_heads=2, inter=48, eps=1e-6, base=10000.0)
BERT = dict(batch=2, seq=6, hidden=32, heads=4, inter=64, eps=1e-12)


def _lin(rng, o, i):
    return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)


def llama_weights(seed: int = 0, c: dict = LLAMA) -> dict[str, np.ndarray]:
    """Seeded weights by Hugging Face LlamaDecoderLayer parameter name."""
    rng = np.random.default_rng(seed)
    h, d = c["hidden"], c["hidden"] // c["heads"]
    kv = c["kv_heads"] * d
    return {
        "input_layernorm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32),
        "self_attn.q_proj.weight": _lin(rng, h, h), "self_attn.k_proj.weight": _lin(rng, kv, h),
        "self_attn.v_proj.weight": _lin(rng, kv, h), "self_attn.o_proj.weight": _lin(rng, h, h),
        "post_attention_layernorm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32),
        "mlp.gate_proj.weight": _lin(rng, c["inter"], h), "mlp.up_proj.weight": _lin(rng, c["inter"], h),
        "mlp.down_proj.weight": _lin(rng, h, c["inter"]),
    }


def bert_weights(seed: int = 1, c: dict = BERT) -> dict[str, np.ndarray]:
    """Seeded weights by Hugging Face BertLayer parameter name."""
    rng = np.random.default_rng(seed)
    h, i = c["hidden"], c["inter"]
    w = {}
    for n, (o, k) in {"attention.self.query": (h, h), "attention.self.key": (h, h),
                      "attention.self.value": (h, h), "attention.output.dense": (h, h),
                      "intermediate.dense": (i, h), "output.dense": (h, i)}.items():
        w[f"{n}.weight"] = _lin(rng, o, k)
        w[f"{n}.bias"] = (0.1 * rng.standard_normal(o)).astype(np.float32)
    for n in ("attention.output.LayerNorm", "output.LayerNorm"):
        w[f"{n}.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        w[f"{n}.bias"] = (0.1 * rng.standard_normal(h)).astype(np.float32)
    return w


def build_llama(w: dict, c: dict = LLAMA, dtype: str = "fp32") -> Graph:
    dt = Dtype.of(dtype)
    b = GraphBuilder("llama_layer")
    x = b.add_input("x", TensorDesc((c["batch"], c["seq"], c["hidden"]), dt))
    ids = {k: b.add_weight(k, v.astype(dt.numpy)) for k, v in w.items()}
    hp = {"num_heads": c["heads"], "num_kv_heads": c["kv_heads"]}
    h, = b.add_node("RmsNorm", [x, ids["input_layernorm.weight"]], {"eps": c["eps"]}, name="input_norm")
    q, = b.add_node("Linear", [h, ids["self_attn.q_proj.weight"]], name="q_proj")
    k, = b.add_node("Linear", [h, ids["self_attn.k_proj.weight"]], name="k_proj")
    v, = b.add_node("Linear", [h, ids["self_attn.v_proj.weight"]], name="v_proj")
    q, k = b.add_node("RoPE", [q, k], {**hp, "base": c["base"], "rotary_type": "half"}, name="rope")
    a, = b.add_node("FlashAttention", [q, k, v], {**hp, "causal": True}, name="attn")
    o, = b.add_node("Linear", [a, ids["self_attn.o_proj.weight"]], name="o_proj")
    r1, = b.add_node("ResidualAdd", [o, x], name="attn_residual")
    h2, = b.add_node("RmsNorm", [r1, ids["post_attention_layernorm.weight"]], {"eps": c["eps"]},
                     name="post_norm")
    g, = b.add_node("Linear", [h2, ids["mlp.gate_proj.weight"]], name="gate_proj")
    u, = b.add_node("Linear", [h2, ids["mlp.up_proj.weight"]], name="up_proj")
    m, = b.add_node("SwiGLU", [g, u], name="act")
    d, = b.add_node("Linear", [m, ids["mlp.down_proj.weight"]], name="down_proj")
    out, = b.add_node("ResidualAdd", [d, r1], name="out")
    b.mark_output(out)
    return b.build()


def build_bert(w: dict, c: dict = BERT, dtype: str = "fp32") -> Graph:
    dt = Dtype.of(dtype)
    bs, s, h = c["batch"], c["seq"], c["hidden"]
    b = GraphBuilder("bert_layer")
    x = b.add_input("x", TensorDesc((bs, s, h), dt))
    mask = b.add_input("mask", TensorDesc((bs, 1, 1, s), dt))
    ids = {k: b.add_weight(k, v.astype(dt.numpy)) for k, v in w.items()}

    def lin(t, n, name):
        return b.add_node("Linear", [t, ids[f"{n}.weight"], ids[f"{n}.bias"]], name=name)[0]

    q, k, v = (lin(x, f"attention.self.{n}", n) for n in ("query", "key", "value"))
    a, = b.add_node("FlashAttention", [q, k, v, mask], {"num_heads": c["heads"]}, name="attn")
    o = lin(a, "attention.output.dense", "attn_out")
    r1, = b.add_node("ResidualAdd", [o, x], name="attn_residual")
    h1, = b.add_node("LayerNorm", [r1, ids["attention.output.LayerNorm.weight"],
                                   ids["attention.output.LayerNorm.bias"]], {"eps": c["eps"]},
                     name="attn_norm")
    i = lin(h1, "intermediate.dense", "intermediate")
    g, = b.add_node("Gelu", [i], name="gelu")
    d = lin(g, "output.dense", "ffn_out")
    r2, = b.add_node("ResidualAdd", [d, h1], name="ffn_residual")
    out, = b.add_node("LayerNorm", [r2, ids["output.LayerNorm.weight"], ids["output.LayerNorm.bias"]],
                      {"eps": c["eps"]}, name="out")
    b.mark_output(out)
    return b.build()


def bert_mask(c: dict = BERT, dtype=np.float32) -> np.ndarray:
    """Additive padding mask [B, 1, 1, S]: the second sequence is 2 tokens shorter."""
    m = np.zeros((c["batch"], 1, 1, c["seq"]), np.float32)
    m[1, ..., -2:] = -1e4
    return m.astype(dtype)


# ----------------------------------------------------------------------------- plain MindSpore


def _dense(w: dict, name: str, bias: bool) -> nn.Dense:
    wt = w[f"{name}.weight"]
    d = nn.Dense(wt.shape[1], wt.shape[0], has_bias=bias)
    d.weight.set_data(Tensor(wt))
    if bias:
        d.bias.set_data(Tensor(w[f"{name}.bias"]))
    return d


def _attention(q, k, v, heads, kv_heads, mask):
    """q [B, S, H*D], k/v [B, S, Hkv*D]; softmax attention by hand, [B, S, H*D]."""
    b, s, hd = q.shape
    d = hd // heads
    q = ops.transpose(q.reshape((b, s, heads, d)), (0, 2, 1, 3))            # [B, H, S, D]
    k = ops.transpose(k.reshape((b, s, kv_heads, d)), (0, 2, 1, 3))         # [B, Hkv, S, D]
    v = ops.transpose(v.reshape((b, s, kv_heads, d)), (0, 2, 1, 3))
    if kv_heads != heads:
        k = ops.repeat_interleave(k, heads // kv_heads, 1)
        v = ops.repeat_interleave(v, heads // kv_heads, 1)
    scores = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) / float(np.sqrt(d)) + mask
    p = ops.softmax(scores, -1)
    o = ops.matmul(p, v)                                                     # [B, H, S, D]
    return ops.transpose(o, (0, 2, 1, 3)).reshape((b, s, hd))


class PlainLlama(nn.Cell):
    """LlamaDecoderLayer in plain MindSpore (RMSNorm, RoPE, GQA attention by hand)."""

    def __init__(self, w: dict, c: dict = LLAMA) -> None:
        super().__init__()
        self.c = c
        self.q, self.k, self.v, self.o = (_dense(w, f"self_attn.{n}_proj", False) for n in "qkvo")
        self.gate, self.up, self.down = (_dense(w, f"mlp.{n}_proj", False) for n in ("gate", "up", "down"))
        self.w_in = Tensor(w["input_layernorm.weight"])
        self.w_post = Tensor(w["post_attention_layernorm.weight"])
        d, s = c["hidden"] // c["heads"], c["seq"]
        inv = c["base"] ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        ang = np.arange(s)[:, None] * inv[None]
        full = np.concatenate([ang, ang], -1)                                 # [S, D]
        self.cos = Tensor(np.cos(full).astype(np.float32).reshape(1, s, 1, d))
        self.sin = Tensor(np.sin(full).astype(np.float32).reshape(1, s, 1, d))
        self.mask = Tensor(np.triu(np.full((s, s), -np.inf, np.float32), 1))

    def _rms(self, x, w):
        return x * ops.rsqrt(ops.mean(x * x, -1, keep_dims=True) + self.c["eps"]) * w

    def _rope(self, x, heads):
        b, s, hd = x.shape
        d = hd // heads
        x4 = x.reshape((b, s, heads, d))
        rot = ops.concat([-x4[..., d // 2:], x4[..., :d // 2]], -1)
        return (x4 * self.cos + rot * self.sin).reshape((b, s, hd))

    def construct(self, x):
        c = self.c
        h = self._rms(x, self.w_in)
        q, k, v = self._rope(self.q(h), c["heads"]), self._rope(self.k(h), c["kv_heads"]), self.v(h)
        r1 = x + self.o(_attention(q, k, v, c["heads"], c["kv_heads"], self.mask))
        h2 = self._rms(r1, self.w_post)
        return r1 + self.down(ops.silu(self.gate(h2)) * self.up(h2))


class PlainBert(nn.Cell):
    """BertLayer in plain MindSpore (nn.Dense, nn.LayerNorm, attention by hand)."""

    def __init__(self, w: dict, c: dict = BERT) -> None:
        super().__init__()
        self.c = c
        self.q, self.k, self.v = (_dense(w, f"attention.self.{n}", True) for n in ("query", "key", "value"))
        self.o = _dense(w, "attention.output.dense", True)
        self.i = _dense(w, "intermediate.dense", True)
        self.d = _dense(w, "output.dense", True)
        self.ln1 = nn.LayerNorm((c["hidden"],), epsilon=c["eps"])
        self.ln2 = nn.LayerNorm((c["hidden"],), epsilon=c["eps"])
        for ln, n in ((self.ln1, "attention.output.LayerNorm"), (self.ln2, "output.LayerNorm")):
            ln.gamma.set_data(Tensor(w[f"{n}.weight"]))
            ln.beta.set_data(Tensor(w[f"{n}.bias"]))

    def construct(self, x, mask):
        c = self.c
        a = _attention(self.q(x), self.k(x), self.v(x), c["heads"], c["heads"], mask)
        h1 = self.ln1(x + self.o(a))
        return self.ln2(h1 + self.d(ops.gelu(self.i(h1), approximate="none")))


