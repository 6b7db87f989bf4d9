"""The encoder lowering (:func:`atbcore.models.encoder.encoder_layers`) from a neutral
spec and NumPy weights: the fused graph's shape (residual adds in the GEMM
epilogues, the embeddings' add in their LayerNorm, GELU in the up projection, one
UnpadFlashAttention per block) and its outputs on NumPy and torch inputs against a float64 NumPy BERT run
sequence by sequence (no padding anywhere), empty sequences included."""

import math

import numpy as np
import pytest

from atbcore.errors import CapabilityError
from atbcore.graph.graph_op import GraphOp
from atbcore.models.arch import LayerWeights, ModelSpec, ModelWeights
from atbcore.models.encoder import ENCODER_FUSION, encoder_dim_names, encoder_layers
from atbcore.numerics import assert_close

H, HEADS, INTER, LAYERS, VOCAB, POS, TYPES, EPS = 32, 4, 48, 2, 40, 24, 2, 1e-12


def _spec(**kw):
    base = dict(arch="bert", kind="encoder", hidden_size=H, num_layers=LAYERS, num_heads=HEADS,
                num_kv_heads=HEADS, head_dim=H // HEADS, intermediate_size=INTER,
                vocab_size=VOCAB, norm="layer", norm_eps=EPS, activation="gelu", gated=False,
                position="learned", windows=(None,) * LAYERS,
                scales=(1 / math.sqrt(H // HEADS),) * LAYERS, post_norm=True,
                max_positions=POS, type_vocab_size=TYPES, embed_norm=True, pooler=True)
    base.update(kw)
    return ModelSpec(**base)


def _weights(seed=0):
    rng = np.random.default_rng(seed)

    def r(*shape, s=0.2):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    def norm():
        return (1 + r(H, s=0.1)), r(H, s=0.1)
    layers = []
    for _ in range(LAYERS):
        (n1, b1), (n2, b2) = norm(), norm()
        layers.append(LayerWeights(q=r(H, H), k=r(H, H), v=r(H, H), o=r(H, H), q_b=r(H), k_b=r(H),
                                   v_b=r(H), o_b=r(H), attn_norm=n1, attn_norm_b=b1,
                                   up=r(INTER, H), up_b=r(INTER), down=r(H, INTER), down_b=r(H),
                                   mlp_norm=n2, mlp_norm_b=b2))
    en, eb = norm()
    return ModelWeights(embed=r(VOCAB, H, s=1.0), layers=layers, pos_embed=r(POS, H),
                        type_embed=r(TYPES, H), embed_norm=en, embed_norm_b=eb,
                        pooler=r(H, H), pooler_b=r(H))


def _ln(x, w, b):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + EPS) * w + b


def _gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def _np_bert(w, ids, pos, tt):
    """One sequence [n] in float64 -> (hidden [n, H], pooled [H])."""
    f = {k: np.asarray(v, np.float64) for k, v in vars(w).items() if isinstance(v, np.ndarray)}
    x = _ln(f["embed"][ids] + f["pos_embed"][pos] + f["type_embed"][tt], f["embed_norm"],
            f["embed_norm_b"])
    n, d = len(ids), H // HEADS
    for lw in w.layers:
        g = {k: np.asarray(v, np.float64) for k, v in vars(lw).items() if v is not None}

        def heads(t):                                                    # [n, H] -> [heads, n, d]
            return t.reshape(n, HEADS, d).transpose(1, 0, 2)
        q, k, v = (heads(x @ g[p].T + g[p + "_b"]) for p in "qkv")
        s = q @ k.transpose(0, 2, 1) / math.sqrt(d)
        p = np.exp(s - s.max(-1, keepdims=True))
        o = ((p / p.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(n, H)
        y = _ln(o @ g["o"].T + g["o_b"] + x, g["attn_norm"], g["attn_norm_b"])
        m = _gelu(y @ g["up"].T + g["up_b"]) @ g["down"].T + g["down_b"]
        x = _ln(m + y, g["mlp_norm"], g["mlp_norm_b"])
    return x, np.tanh(x[0] @ f["pooler"].T + f["pooler_b"])


def _batch(lens, seed=1):
    rng = np.random.default_rng(seed)
    t = sum(lens)
    ids = rng.integers(0, VOCAB, t)
    pos = np.concatenate([rng.permutation(POS)[:n] for n in lens]).astype(np.int64)
    tt = rng.integers(0, TYPES, t)
    lens = np.array(lens, np.int32)
    first = (np.cumsum(lens) - lens).clip(max=t - 1).astype(np.int64)
    return ids, pos, tt, lens, first


def test_fused_graph():
    op = GraphOp(encoder_layers(_spec(), _weights()), name="bert", dim_names=encoder_dim_names(),
                 fusion_config=ENCODER_FUSION)
    ids, pos, tt, lens, first = _batch([5, 3])
    op(ids, tt * POS + pos, lens, first)
    ops = [n.op for n in op.graph.nodes]
    assert "ResidualAdd" not in ops                                      # all in GEMM epilogues
    assert ops.count("UnpadFlashAttention") == LAYERS and ops.count("AddLayerNorm") == 1
    assert ops.count("LinearActivation") == LAYERS                      # GELU in the up GEMM
    by = {n.name: n for n in op.graph.nodes}
    for i in range(LAYERS):
        assert by[f"l{i}.o"].inputs[-1] == ("embed" if i == 0 else f"l{i - 1}.mlp_norm")
        assert by[f"l{i}.mlp"].inputs[-1] == f"l{i}.attn_norm"
    assert op.graph.outputs == ("l1.mlp_norm", "pooler")


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_against_numpy_bert(framework):
    w = _weights()
    op = GraphOp(encoder_layers(_spec(), w), name="bert", dim_names=encoder_dim_names(),
                 fusion_config=ENCODER_FUSION)
    lens = [7, 0, 12, 1]
    ids, pos, tt, ln, first = _batch(lens)
    ins = [ids, tt * POS + pos, ln, first]
    if framework == "torch":
        torch = pytest.importorskip("torch")
        ins = [torch.from_numpy(np.ascontiguousarray(a)) for a in ins]
    hidden, pooled = op(*ins)
    hidden, pooled = np.asarray(hidden), np.asarray(pooled)
    start = 0
    for b, n in enumerate(lens):
        sl = slice(start, start + n)
        if n:
            ref_h, ref_p = _np_bert(w, ids[sl], pos[sl], tt[sl])
            assert_close(hidden[sl], ref_h, "fp32", f"{framework} sequence {b}")
            assert_close(pooled[b], ref_p, "fp32", f"{framework} pooler {b}")
        start += n


def test_unsupported_specs_are_named():
    with pytest.raises(CapabilityError, match="pre-norm"):
        encoder_layers(_spec(post_norm=False), _weights())
    with pytest.raises(CapabilityError, match="gated"):
        encoder_layers(_spec(gated=True), _weights())
    with pytest.raises(CapabilityError, match="decoder"):
        encoder_layers(_spec(kind="decoder"), _weights())
