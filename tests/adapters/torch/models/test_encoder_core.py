"""compile() of encoders on the core engine (:mod:`atb_torch.models.lower_encoder`):
one layer against a float64 NumPy reference of the embeddings and a post-norm BERT
layer, whole tiny BERTs (GELU, tanh-GELU, ReLU, SiLU; fp32 and bf16; light and heavy
padding; an empty row) against Hugging Face eager, and the plan's fusions and weight
layouts per option."""

import numpy as np
import pytest
import torch

from atbcore.errors import InputError
from atbcore.numerics import assert_close
from atb_torch.models import compile
from atb_torch.models.lower_encoder import CoreEncoder
from tiny_models import tiny


def _np_layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _np_gelu(x):
    from math import erf, sqrt

    return 0.5 * x * (1 + np.vectorize(erf)(x / sqrt(2)))


def _np_bert_layer(x, mask, lw, heads, eps):
    """Post-norm BERT layer in float64: x [B, S, H], mask bool [B, S] (keys)."""
    b, s, h = x.shape
    d = h // heads

    def lin(t, name):
        return t @ lw[name + ".weight"].T + lw[name + ".bias"]

    def split(t):                                                        # [B, S, H] -> [B, nh, S, d]
        return t.reshape(b, s, heads, d).transpose(0, 2, 1, 3)

    q = split(lin(x, "attention.self.query"))
    k = split(lin(x, "attention.self.key"))
    v = split(lin(x, "attention.self.value"))
    sc = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d)
    sc = np.where(mask[:, None, None, :], sc, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = (p @ v).transpose(0, 2, 1, 3).reshape(b, s, h)
    y = _np_layer_norm(lin(o, "attention.output.dense") + x, lw["attention.output.LayerNorm.weight"],
                       lw["attention.output.LayerNorm.bias"], eps)
    f = lin(_np_gelu(lin(y, "intermediate.dense")), "output.dense")
    return _np_layer_norm(f + y, lw["output.LayerNorm.weight"], lw["output.LayerNorm.bias"], eps)


def _np_embed(ids, tt, bert, eps):
    """LayerNorm(word + position + token type) in float64: ids, tt [B, S]."""
    e = {k: v.double().numpy() for k, v in bert.embeddings.state_dict().items()}
    s = ids.shape[1]
    x = (e["word_embeddings.weight"][ids] + e["position_embeddings.weight"][np.arange(s)][None]
         + e["token_type_embeddings.weight"][tt])
    return _np_layer_norm(x, e["LayerNorm.weight"], e["LayerNorm.bias"], eps)


@pytest.mark.parametrize("padding", [False, True])
def test_one_layer_against_numpy(padding):
    bert = tiny("bert")
    bert.encoder.layer = bert.encoder.layer[:1]
    bert.config.num_hidden_layers = 1
    c = compile(bert, opt_level=1)
    assert isinstance(c.atb_runner, CoreEncoder)
    b, s = 3, 10
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (b, s), generator=g)
    tt = torch.randint(0, 2, (b, s), generator=g)
    m = torch.ones(b, s, dtype=torch.bool)
    if padding:
        m[1, 6:] = False
        m[2, 3:] = False
    eps = bert.config.layer_norm_eps
    lw = {k: v.double().numpy() for k, v in bert.encoder.layer[0].state_dict().items()}
    ref = _np_bert_layer(_np_embed(ids.numpy(), tt.numpy(), bert, eps), m.numpy(), lw, 4, eps)
    with torch.no_grad():
        out = c(ids, attention_mask=m.long(), token_type_ids=tt).last_hidden_state
    assert_close(out[m], torch.from_numpy(ref[m.numpy()]).float(), "fp32", "one layer")
    assert bool((out[~m] == 0).all())


def _batch(b=4, s=16, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (b, s), generator=g)
    tt = torch.randint(0, 2, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, 14:] = 0                                                     # 59 of 64 real: padded
    mask[3, 13:] = 0
    return ids, tt, mask


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu", "silu"])
@pytest.mark.parametrize("heavy_padding", [False, True])
def test_tiny_bert_activations_against_hf(act, heavy_padding):
    bert = tiny("bert", hidden_act=act)
    c = compile(bert, opt_level=2)
    ids, tt, mask = _batch()
    if heavy_padding:
        mask[0, 4:] = 0                                                  # 47 of 64 real: packed
    pos = torch.arange(16).flip(0)[None].expand(4, 16)                   # any positions
    with torch.no_grad():
        ref = bert(ids, attention_mask=mask, token_type_ids=tt, position_ids=pos)
        out = c(ids, attention_mask=mask, token_type_ids=tt, position_ids=pos)
    assert isinstance(c.atb_runner, CoreEncoder)
    real = mask.bool()
    assert_close(out.last_hidden_state[real], ref.last_hidden_state[real], "fp32", act)
    assert bool((out.last_hidden_state[~real] == 0).all())
    assert_close(out.pooler_output, ref.pooler_output, "fp32", "pooler")


def test_bf16_compute_close_to_fp32_hf():
    bert = tiny("bert")
    c = compile(bert, dtype=torch.bfloat16)
    ids, tt, mask = _batch()
    with torch.no_grad():
        ref = bert(ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
        out = c(ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
    assert isinstance(c.atb_runner, CoreEncoder) and out.dtype == torch.bfloat16
    real = mask.bool()
    cos = torch.nn.functional.cosine_similarity(out[real].double(), ref[real].double(), dim=-1)
    assert float(cos.min()) >= 0.999, float(cos.min())


def test_empty_row_gives_zeros_and_leaves_others_exact():
    bert = tiny("bert")
    c = compile(bert)
    ids, tt, mask = _batch()
    mask[2] = 0
    with torch.no_grad():
        out = c(ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
        keep = [0, 1, 3]
        ref = bert(ids[keep], attention_mask=mask[keep], token_type_ids=tt[keep]).last_hidden_state
    assert bool(torch.isfinite(out).all()) and bool((out[2] == 0).all())
    real = mask[keep].bool()
    assert_close(out[keep][real], ref[real], "fp32", "other rows")


def test_embedding_indices_out_of_range_raise():
    bert = tiny("bert")
    c = compile(bert)
    ids, tt, mask = _batch()
    with pytest.raises(InputError, match="token_type_ids"):
        c(ids, attention_mask=mask, token_type_ids=tt + 5)
    with pytest.raises(InputError, match="input_ids"):
        c(ids + 256, attention_mask=mask, token_type_ids=tt)
    with pytest.raises(InputError, match="position_ids"):
        c(ids, attention_mask=mask, position_ids=torch.arange(16)[None] + 120)


def _ran(c, b=8, s=12):
    """The explain() of ``c`` run once on a [b, s] batch (its plan bound for b * s rows)."""
    with torch.no_grad():
        c(torch.randint(0, 256, (b, s), generator=torch.Generator().manual_seed(1)))
    return c.atb_runner.explain()


def _after_fusion(c):
    text = _ran(c)
    return text[text.index("After fusion"):text.index("Plan for")]


def test_plan_fuses_what_the_hand_written_encoder_did():
    """opt >= 1: embeddings' add in their LayerNorm, bias + GELU in the up GEMM,
    residual adds in the o / down GEMMs' epilogues; opt 0: every node its own."""
    bert = tiny("bert")
    fused = _after_fusion(compile(bert))
    assert "AddLayerNorm(embed.word, embed.pos_type" in fused
    assert "l0.act: LinearActivation(l0.attn_norm, l0.up.weight, l0.up.bias)" in fused
    assert "l0.o: Linear(l0.attn, l0.o.weight, l0.o.bias, -, embed) -> l0.attn_out" in fused
    assert "l1.mlp: Linear(l1.act, l1.mlp.weight, l1.mlp.bias, -, l1.attn_norm)" in fused
    assert "ResidualAdd" not in fused
    plain = _after_fusion(compile(bert, opt_level=0))
    assert "LinearActivation" not in plain and "AddLayerNorm" not in plain
    assert plain.count("ResidualAdd") == 1 + 2 * bert.config.num_hidden_layers


@pytest.mark.parametrize("kw,layout", [({}, "32-output panels"),
                                       ({"quantize": "w8"}, "int8 32-output panels (w8)"),
                                       ({"quantize": "w8a8"}, "w8a8 VNNI panels"),
                                       ({"dtype": torch.bfloat16}, "32-output panels")])
def test_weight_layouts_by_option(kw, layout):
    """Each option's Linears read their weights in its kernel's layout, at a batch of
    many rows too: fp32 and bf16 the C matmul's panels, w8 int8 panels, w8a8 VNNI
    panels (the up projection's fused GELU, a oneDNN GEMM, reads its [out, in] rows)."""
    from atbcore.runtime.binding import POOL_ROWS_MAX

    text = _ran(compile(tiny("bert"), **kw), b=8, s=12)
    assert 8 * 12 > POOL_ROWS_MAX  # rows past the decode steps' pool split
    assert f"weight weight: {layout}" in text


def test_inputs_embeds():
    bert = tiny("bert")
    c = compile(bert)
    ids, tt, mask = _batch()
    emb = bert.embeddings.word_embeddings(ids)
    with torch.no_grad():
        ref = bert(inputs_embeds=emb, attention_mask=mask, token_type_ids=tt).last_hidden_state
        out = c(inputs_embeds=emb, attention_mask=mask, token_type_ids=tt).last_hidden_state
    assert isinstance(c.atb_runner, CoreEncoder)
    real = mask.bool()
    assert_close(out[real], ref[real], "fp32", "inputs_embeds")


@pytest.mark.parametrize("padding", ["right_padded", "right_packed", "left_padded", "left_packed"])
def test_attention_kernel_by_padding_side(padding):
    """Every batch is packed (real tokens only), so each layer's attention is one C
    prefill attention call whatever the padding side or share; all equal HF."""
    from atbcore.backends.cpu_kernels import available
    from atbcore.backends.cpu_kernels.counting import LaunchCounter

    bert = tiny("bert")
    c = compile(bert, opt_level=2)
    ids, tt, _ = _batch()
    lens = [16, 15, 14, 16] if padding.endswith("padded") else [16, 3, 9, 1]   # >= 90 %: padded
    mask = torch.zeros(4, 16, dtype=torch.long)
    for i, n in enumerate(lens):
        if padding.startswith("right"):
            mask[i, :n] = 1
        else:
            mask[i, 16 - n:] = 1
    with torch.no_grad(), LaunchCounter() as lc:
        out = c(ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
    with torch.no_grad():
        ref = bert(ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
    real = mask.bool()
    assert_close(out[real], ref[real], "fp32", padding)
    c_calls = lc.ops.count("prefill_attention")
    layers = bert.config.num_hidden_layers
    assert c_calls == (layers if available() else 0)
