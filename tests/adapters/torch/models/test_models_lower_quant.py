"""A quantized Hugging Face decoder lowered to one core GraphOp
(``lower_decoder(model, quantize=...)``): its logits, for the prompt and decode steps,
equal the hand-written runner's quantized logits (the same codes, the same C kernels),
greedy tokens agree with the runner's, and the quantized Linears are fused and bound
as the float ones are, their packed layouts named in ``explain()``."""

import pytest
import torch
import torch.nn.functional as F

import atb_torch as atb
from atb_torch.models import compile
from atb_torch.models.lower import lower_decoder
from atbcore.backends.cpu_kernels import available
from atbcore.errors import ParamsError
from atbcore.memory import KVCache
from atbcore.tensor import describe
from tiny_models import VOCAB, tiny

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler here: C kernels absent")

# the runner's own tests' bounds on the logits cosine to the fp32 model
COSINE = {"w8": 0.995, "w8a8": 0.995, "w4": 0.975}
LAYOUT = {"w8": "int8 32-output panels (w8)", "w8a8": "w8a8 VNNI panels",
          "w4": "w4 32-output panels"}


def _cache(model, batch, dtype="fp32"):
    c = model.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return KVCache(c.num_hidden_layers, batch, 32, c.num_key_value_heads, hd, dtype=dtype)


def _lowered_logits(op, ids, cache, prompt):
    got = [op(ids[:, :prompt], kv_cache=cache)[0]]
    got += [op(ids[:, t:t + 1], kv_cache=cache)[0] for t in range(prompt, ids.shape[1])]
    return torch.cat(got, dim=1)


@pytest.mark.parametrize("quantize", ["w8", "w8a8", "w4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
def test_lowered_quantized_logits_equal_the_runners(arch, quantize):
    hf = tiny(arch)
    op = lower_decoder(hf, quantize=quantize)
    runner = compile(hf, quantize=quantize)
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = _lowered_logits(op, ids, _cache(hf, 2), 7)
        want = runner(ids).logits
        fp32 = hf(ids).logits
    atb.assert_close(got, want, "fp32", f"lowered {arch} {quantize} vs the runner's")
    cos = float(F.cosine_similarity(got.reshape(-1, VOCAB), fp32.reshape(-1, VOCAB)).min())
    assert cos >= COSINE[quantize] and not torch.equal(got, fp32)  # really quantized
    # fused as the float graph: norms inside the QKV / gate|up / LM head matmuls,
    # residual adds in the o and down projections' epilogues; every Linear quantized
    nodes = op._in_place.graph.nodes
    layers = hf.config.num_hidden_layers
    moe = [n for n in nodes if n.op == "MoE"]   # experts quantized inside the MoE node
    per_layer = 2 if moe else 4
    assert len(moe) == (layers if arch == "mixtral" else 0)
    assert all(n.params.quant == quantize for n in moe)
    lins = [n for n in nodes if n.op in ("Linear", "RmsNormLinear")]
    assert {n.params.quant for n in lins} == {quantize}
    assert len(lins) == per_layer * layers + 1
    if not moe:  # the MoE node takes no residual: its add goes with the next norm instead
        assert sum(n.op == "RmsNormLinear" for n in lins) == 2 * layers + 1
        assert sum(n.op == "Linear" and len(n.inputs) == 5 for n in lins) == 2 * layers
        assert not any(n.op in ("RmsNorm", "AddRmsNorm", "ResidualAdd") for n in nodes)
    text = op._in_place.explain()
    assert text.count(f"weight weight: {LAYOUT[quantize]}") == per_layer * layers + 1
    assert "bound once" in text


@pytest.mark.parametrize("quantize", ["w8", "w4"])
def test_lowered_quantized_greedy_tokens_agree_with_the_runner(quantize):
    hf = tiny("llama")
    op = lower_decoder(hf, last_token=True, quantize=quantize)
    runner = compile(hf, quantize=quantize)
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    cache = _cache(hf, 1)
    with torch.no_grad():
        want = runner.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
        toks = [op(ids, kv_cache=cache)[0][:, -1].argmax(-1)]
        for _ in range(9):
            toks.append(op(toks[-1][:, None], kv_cache=cache)[0][:, -1].argmax(-1))
    assert torch.stack(toks, 1)[0].tolist() == want[0, 6:].tolist()


@pytest.mark.parametrize("quantize", ["w8", "w4"])
def test_lowered_quantized_bf16_model(quantize):
    """A bf16 model keeps the C kernels' scales (fp32 per channel for w8, fp16 per group
    for w4) and computes in bf16."""
    hf = tiny("llama").to(torch.bfloat16)
    op = lower_decoder(hf, quantize=quantize)
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = _lowered_logits(op, ids, _cache(hf, 2, "bf16"), 5)
        want = compile(hf, quantize=quantize, dtype=torch.bfloat16)(ids).logits
    assert got.dtype == torch.bfloat16
    if quantize == "w8":
        atb.assert_close(got.float(), want.float(), "bf16", "lowered bf16 w8 vs the runner's")
    else:  # int8 activation blocks turn a one-ulp bf16 difference into a code step
        cos = F.cosine_similarity(got.float().reshape(-1, VOCAB), want.float().reshape(-1, VOCAB))
        assert float(cos.min()) >= 0.9995, float(cos.min())
    scales = {n: w for n, w in op.graph.weights if n.endswith(".scale")}
    want_dt = "float32" if quantize == "w8" else "float16"
    # the logical dtype (a w4 scale is held packed by the layout pass: its descriptor's)
    assert scales and all(describe(w).dtype.value == want_dt for w in scales.values())


def test_lowered_quantize_refusal_names_the_modes():
    with pytest.raises(ParamsError, match="'w4'"):
        lower_decoder(tiny("llama"), quantize="w3")
