"""The seed article's two blocks, as written, and an equivalent plain-PyTorch model.

``AcceleratedTransformerBlock`` / ``AcceleratedLLaMA`` are the seed's code with the
free names filled in (``atb.KVCache(...)`` gets its sizes). ``PlainLLaMA`` computes
the same function with torch.nn only; :func:`copy_weights` gives it the atb model's
weights, so the two must agree within DESIGN.md §5.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import atb_torch as atb


class AcceleratedTransformerBlock(nn.Module):
    def __init__(self, hidden_dim, num_heads, mlp_dim):
        super().__init__()

        # 定义注意力图算子
        self.attention_graph = atb.GraphOp([
            atb.LayerNorm(eps=1e-5),
            atb.FlashAttention(num_heads=num_heads,
                               causal=True,          # 因果掩码
                               kv_cache=True),       # 启用KV Cache管理
            atb.Linear(out_features=hidden_dim),
            atb.ResidualAdd()
        ])

        # 定义MLP图算子
        self.mlp_graph = atb.GraphOp([
            atb.LayerNorm(eps=1e-5),
            atb.Linear(out_features=mlp_dim),
            atb.SiLU(),                    # SwiGLU激活
            atb.Linear(out_features=hidden_dim),
            atb.ResidualAdd()
        ])

    def forward(self, x, kv_cache=None):
        x, kv_cache = self.attention_graph(x, kv_cache=kv_cache)
        x = self.mlp_graph(x)
        return x, kv_cache


class AcceleratedLLaMA(nn.Module):
    def __init__(self, vocab_size, hidden_dim, num_layers, num_heads, mlp_dim,
                 max_batch=2, max_seq_len=32, dtype=torch.float32):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, hidden_dim)
        self.layers = nn.ModuleList([
            AcceleratedTransformerBlock(hidden_dim, num_heads, mlp_dim)
            for _ in range(num_layers)
        ])
        self.norm = nn.LayerNorm(hidden_dim)
        self.lm_head = nn.Linear(hidden_dim, vocab_size, bias=False)
        self.kv_cache = atb.KVCache(num_layers, max_batch, max_seq_len, num_heads,
                                    hidden_dim // num_heads, dtype=dtype)  # 初始化KV Cache池

    def forward(self, input_ids):
        x = self.embedding(input_ids)
        for layer in self.layers:
            x, self.kv_cache = layer(x, kv_cache=self.kv_cache)
        x = self.norm(x)
        return self.lm_head(x)


class PlainBlock(nn.Module):
    """LN -> q/k/v -> causal SDPA (past keys first) -> out proj -> +x; LN -> fc1 ->
    SiLU -> fc2 -> +x.

    ``round_to(dtype)`` makes it the oracle of a half-precision GraphOp: it computes in
    fp32 and rounds to ``dtype`` where the fused graph's tensors are (each node's
    output: norms, projections, attention; the output projection with the residual
    add in its epilogue rounds once, as does the fused FFN with its residual), as
    DESIGN.md says kernels do."""

    def __init__(self, hidden, heads, mlp):
        super().__init__()
        self.heads = heads
        self.rd = lambda t: t
        self.ln1, self.ln2 = nn.LayerNorm(hidden, eps=1e-5), nn.LayerNorm(hidden, eps=1e-5)
        self.q, self.k, self.v = (nn.Linear(hidden, hidden, bias=False) for _ in range(3))
        self.o = nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, mlp), nn.Linear(mlp, hidden)

    def round_to(self, dtype):
        self.to(dtype).float()  # the rounded weights, in fp32
        self.rd = lambda t: t.to(dtype).float()
        return self

    def forward(self, x, past=None):
        rd = self.rd
        b, s, h = x.shape
        n = rd(self.ln1(x))
        q, k, v = rd(self.q(n)), rd(self.k(n)), rd(self.v(n))
        if past is not None:
            k, v = torch.cat([past[0], k], 1), torch.cat([past[1], v], 1)
        t, d = k.shape[1], h // self.heads
        qh = q.view(b, s, self.heads, d).transpose(1, 2)      # [B, H, S, D]
        kh = k.view(b, t, self.heads, d).transpose(1, 2)      # [B, H, T, D]
        vh = v.view(b, t, self.heads, d).transpose(1, 2)
        keep = torch.ones(s, t, dtype=torch.bool).tril(t - s)  # bottom-right causal
        a = rd(F.scaled_dot_product_attention(qh, kh, vh, attn_mask=keep))
        x = rd(self.o(a.transpose(1, 2).reshape(b, s, h)) + x)
        x = rd(self.fc2(F.silu(self.fc1(rd(self.ln2(x))))) + x)
        return x, (k, v)


class PlainLLaMA(nn.Module):
    def __init__(self, vocab, hidden, layers, heads, mlp):
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([PlainBlock(hidden, heads, mlp) for _ in range(layers)])
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def round_to(self, dtype):
        """Blocks as :meth:`PlainBlock.round_to`; embedding, norm and head in ``dtype``
        (plain torch modules in both models)."""
        self.to(dtype)
        for layer in self.layers:
            layer.round_to(dtype)
        return self

    def forward(self, ids):
        x = self.embedding(ids)
        dt = x.dtype
        x = x.float()
        for layer in self.layers:
            x, _ = layer(x)
        return self.lm_head(self.norm(x.to(dt)))


_BLOCK_KEYS = {
    "attention_graph.layers.layer_norm.weight": "ln1.weight",
    "attention_graph.layers.layer_norm.bias": "ln1.bias",
    "attention_graph.layers.attention.q_proj.weight": "q.weight",
    "attention_graph.layers.attention.k_proj.weight": "k.weight",
    "attention_graph.layers.attention.v_proj.weight": "v.weight",
    "attention_graph.layers.linear.weight": "o.weight",
    "attention_graph.layers.linear.bias": "o.bias",
    "mlp_graph.layers.layer_norm.weight": "ln2.weight",
    "mlp_graph.layers.layer_norm.bias": "ln2.bias",
    "mlp_graph.layers.linear.weight": "fc1.weight",
    "mlp_graph.layers.linear.bias": "fc1.bias",
    "mlp_graph.layers.linear_1.weight": "fc2.weight",
    "mlp_graph.layers.linear_1.bias": "fc2.bias",
}


def block_state_to_plain(sd):
    """An AcceleratedTransformerBlock state_dict under PlainBlock's names."""
    return {_BLOCK_KEYS[k]: v for k, v in sd.items()}


def copy_weights(atb_model, plain):
    """Give ``plain`` (PlainLLaMA) the weights of ``atb_model`` (AcceleratedLLaMA)."""
    sd = {}
    for k, v in atb_model.state_dict().items():
        if k.startswith("layers."):
            i, rest = k.split(".", 2)[1:]
            sd[f"layers.{i}.{_BLOCK_KEYS[rest]}"] = v
        else:
            sd[k] = v
    plain.load_state_dict(sd)
    return plain
