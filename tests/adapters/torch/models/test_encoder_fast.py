"""The encoder fast path (:mod:`atb_torch.models.encoder_fast`): one layer against a
float64 NumPy reference of a post-norm BERT layer, whole tiny BERTs (GELU, tanh-GELU,
ReLU; fp32 and bf16; padded and packed batches; an empty row) against Hugging Face
eager, and the cases that must take the general path. The tests against Hugging
Face run on both encoder engines (the runner's FastEncoder and the core GraphOp,
:mod:`encoder_engines`)."""

import numpy as np
import pytest
import torch

from atbcore.errors import InputError
from atbcore.numerics import assert_close
from atb_torch.models import compile
from atb_torch.models.encoder_fast import FastEncoder, fast_encoder_reason
from encoder_engines import ENGINES, compile_on, is_core
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


@pytest.mark.parametrize("packed", [False, True])
def test_one_layer_against_numpy(packed):
    bert = tiny("bert")
    c = compile(bert, opt_level=1)
    fe = FastEncoder.build(c.atb_runner)
    assert fe is not None
    b, s, h = 3, 10, 64
    x = torch.randn(b, s, h, generator=torch.Generator().manual_seed(5))
    m = torch.ones(b, s, dtype=torch.bool)
    m[1, 6:] = False
    m[2, 3:] = False
    lens = m.sum(1).int()
    lw = {k: v.double().numpy() for k, v in bert.encoder.layer[0].state_dict().items()}
    ref = _np_bert_layer(x.double().numpy(), m.numpy(), lw, 4, bert.config.layer_norm_eps)
    layer = fe.layers[0]
    fe.layers = [layer]
    if packed:
        sel = m.reshape(-1).nonzero().squeeze(1)
        out = fe.run(x.reshape(b * s, h)[sel], m, lens, b, s, sel)      # [T, H]
        assert_close(out, torch.from_numpy(ref.reshape(b * s, h)[sel.numpy()]).float(), "fp32",
                     "packed layer")
    else:
        out = fe.run(x.reshape(b * s, h), m, lens, b, s, None).reshape(b, s, h)
        assert_close(out[m], torch.from_numpy(ref[m.numpy()]).float(), "fp32", "padded layer")


def _batch(b=4, s=16, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (b, s), generator=g)
    tt = torch.randint(0, 2, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, 14:] = 0                                                     # 59 of 64 real: padded
    mask[3, 13:] = 0
    return ids, tt, mask


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu", "silu"])
@pytest.mark.parametrize("heavy_padding", [False, True])
def test_tiny_bert_activations_against_hf(act, heavy_padding, engine):
    bert = tiny("bert", hidden_act=act)
    c = compile_on(bert, engine, opt_level=2)
    ids, tt, mask = _batch()
    if heavy_padding:
        mask[0, 4:] = 0                                                  # 47 of 64 real: packed
    pos = torch.arange(16).flip(0)[None].expand(4, 16)                   # any positions
    with torch.no_grad():
        ref = bert(ids, attention_mask=mask, token_type_ids=tt, position_ids=pos)
        out = c(ids, attention_mask=mask, token_type_ids=tt, position_ids=pos)
    assert is_core(c) or c.atb_runner._fast_encoder is not None
    real = mask.bool()
    assert_close(out.last_hidden_state[real], ref.last_hidden_state[real], "fp32", act)
    assert bool((out.last_hidden_state[~real] == 0).all())
    assert_close(out.pooler_output, ref.pooler_output, "fp32", "pooler")


@pytest.mark.parametrize("engine", ENGINES)
def test_bf16_compute_close_to_fp32_hf(engine):
    bert = tiny("bert")
    c = compile_on(bert, engine, dtype=torch.bfloat16)
    ids, tt, mask = _batch()
    with torch.no_grad():
        ref = bert(ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
        out = c(ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
    assert (is_core(c) or c.atb_runner._fast_encoder is not None) and out.dtype == torch.bfloat16
    real = mask.bool()
    cos = torch.nn.functional.cosine_similarity(out[real].double(), ref[real].double(), dim=-1)
    assert float(cos.min()) >= 0.999, float(cos.min())


@pytest.mark.parametrize("engine", ENGINES)
def test_empty_row_gives_zeros_and_leaves_others_exact(engine):
    bert = tiny("bert")
    c = compile_on(bert, engine)
    ids, tt, mask = _batch()
    mask[2] = 0
    with torch.no_grad():
        out = c(ids, attention_mask=mask, token_type_ids=tt).last_hidden_state
        keep = [0, 1, 3]
        ref = bert(ids[keep], attention_mask=mask[keep], token_type_ids=tt[keep]).last_hidden_state
    assert bool(torch.isfinite(out).all()) and bool((out[2] == 0).all())
    real = mask[keep].bool()
    assert_close(out[keep][real], ref[real], "fp32", "other rows")


@pytest.mark.parametrize("engine", ENGINES)
def test_embedding_indices_out_of_range_raise(engine):
    bert = tiny("bert")
    c = compile_on(bert, engine)
    ids, tt, mask = _batch()
    with pytest.raises(InputError, match="token_type_ids"):
        c(ids, attention_mask=mask, token_type_ids=tt + 5)
    with pytest.raises(InputError, match="input_ids"):
        c(ids + 256, attention_mask=mask, token_type_ids=tt)
    with pytest.raises(InputError, match="position_ids"):
        c(ids, attention_mask=mask, position_ids=torch.arange(16)[None] + 120)


def test_general_path_cases():
    bert = tiny("bert")
    assert "opt_level 0" in fast_encoder_reason(compile(bert, opt_level=0).atb_runner)
    assert "quantize" in fast_encoder_reason(compile(bert, quantize="w8").atb_runner)
    assert "fp32/bf16" in fast_encoder_reason(compile(bert, dtype=torch.float16).atb_runner)
    assert fast_encoder_reason(compile(bert).atb_runner) is None


@pytest.mark.parametrize("engine", ENGINES)
def test_inputs_embeds_take_the_general_embedding_then_the_fast_layers(engine):
    bert = tiny("bert")
    c = compile_on(bert, engine)
    ids, tt, mask = _batch()
    emb = bert.embeddings.word_embeddings(ids)
    with torch.no_grad():
        ref = bert(inputs_embeds=emb, attention_mask=mask, token_type_ids=tt).last_hidden_state
        out = c(inputs_embeds=emb, attention_mask=mask, token_type_ids=tt).last_hidden_state
    assert is_core(c) or c.atb_runner._fast_encoder is not None
    real = mask.bool()
    assert_close(out[real], ref[real], "fp32", "inputs_embeds")


def test_fast_layers_share_the_blocks_weights():
    c = compile(tiny("bert"))
    r = c.atb_runner
    fe = FastEncoder.build(r)
    for layer, blk in zip(fe.layers, r.blocks):
        for w, lin in ((layer.wqkv, blk.qkv), (layer.wo, blk.o), (layer.wup, blk.up),
                       (layer.wdown, blk.down)):
            assert w.shape == (lin.out_features, lin.in_features)
            assert w.untyped_storage().data_ptr() == lin.w.untyped_storage().data_ptr()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("padding", ["right_padded", "right_packed", "left_padded", "left_packed"])
def test_attention_kernel_by_padding_side(padding, engine):
    """Right-padded batches attend through the C prefill attention in place (padded
    rows or packed tokens), left padding packed too; a padded batch with padding first
    keeps SDPA on the runner (the kernel's key counts mean real tokens first), the
    core packs every batch. All equal HF."""
    from atbcore.backends.cpu_kernels import available
    from atbcore.backends.cpu_kernels.counting import LaunchCounter

    bert = tiny("bert")
    c = compile_on(bert, engine, opt_level=2)
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
    runner_sdpa = padding == "left_padded" and not is_core(c)
    assert c_calls == (0 if runner_sdpa or not available() else layers)
