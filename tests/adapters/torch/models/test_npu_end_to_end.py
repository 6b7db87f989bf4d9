"""``compile()`` and ``LLM`` end to end on the NPU kernels, through the torch_npu
conformance double: CPU tensors stand for NPU ones (``use_npu_module(...,
stand_in="cpu")``), so every op with an NPU kernel runs torch_npu's documented call
(validated by the double) and the C CPU kernels step aside. ``compile()`` runs the
core plan there (CoreRunner), ``LLM`` the paged core plan. The greedy tokens must
equal the CPU backend's on the same seeded tiny Llama and Qwen2 (and Mistral, whose
sliding window the decode attention folds into its mask)."""

import logging
import sys
from pathlib import Path

import pytest
import torch

import atb_torch as atb
from atb_torch.models.core_runner import CoreRunner
from atbcore.backends.npu import use_npu_module

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "core" / "backends" / "npu"))
from npu_double import NpuDouble  # noqa: E402
from tiny_models import left_padded, tiny  # noqa: E402

# fp16: every NPU kernel takes it (the fused inference attention ops are fp16/bf16 only)
DTYPE = torch.float16


def _model(arch):
    return tiny(arch, seed=3).to(DTYPE)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_compile_generate_through_the_double_equals_cpu(arch):
    model = _model(arch)
    ids, mask = left_padded([7, 4], seed=5)
    want = atb.compile(model, opt_level=2).generate(ids, attention_mask=mask, max_new_tokens=8,
                                                    do_sample=False)
    with use_npu_module(NpuDouble("A2"), stand_in="cpu") as npu:
        fast = atb.compile(model, opt_level=2)
        got = fast.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        text = fast.atb_runner.explain()
    assert torch.equal(got, want)
    assert isinstance(fast.atb_runner, CoreRunner)  # the core plan, not the runner's
    ran = set(npu.calls)
    # the core's plan also writes the cache with the ATB op (the double has NNAL)
    assert {"npu_rms_norm", "npu_add_rms_norm", "npu_rotary_mul", "npu_swiglu",
            "npu_fusion_attention", "npu_fused_infer_attention_score",
            "_npu_reshape_and_cache"} <= ran, ran
    # the decode plan's attention: one fused inference call per layer and step
    assert npu.calls.count("npu_fused_infer_attention_score") == 2 * 7
    # prefill: one npu_fusion_attention per layer over the gathered rows
    assert npu.calls.count("npu_fusion_attention") == 2
    assert "AddRmsNorm" in text and "device:linear_residual: kept off" in text


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_llm_through_the_double_equals_cpu(arch):
    """LLM on an NPU: the core serving engine over the paged core plan (ids to the
    cache's device, logits back to the host), every decode step one bound program."""
    from atb_torch.llm import LLM

    model = _model(arch)
    prompts = [[5, 17, 33, 9, 81], [44, 12], [7, 7, 100, 3, 19, 250, 61]]
    with LLM(model, max_batch_size=4, block_size=16, num_blocks=16) as cpu:
        want = [o.token_ids for o in cpu.generate_outputs(prompts, max_new_tokens=6,
                                                          ignore_eos=True)]
    with use_npu_module(NpuDouble("A2"), stand_in="cpu") as npu:
        with LLM(model, max_batch_size=4, block_size=16, num_blocks=16) as llm:
            got = [o.token_ids for o in llm.generate_outputs(prompts, max_new_tokens=6,
                                                             ignore_eos=True)]
            text = llm.explain()
            form = llm.decoder._in_place
    assert got == want
    assert form and form._cache_form  # the core plan in its in-place cache form
    ran = set(npu.calls)
    assert {"npu_rms_norm", "npu_add_rms_norm", "npu_rotary_mul", "npu_fusion_attention",
            "_npu_reshape_and_cache", "npu_fused_infer_attention_score", "npu_swiglu"} <= ran, ran
    # 5 decode steps x 2 layers read the paged cache in place with the fused op
    assert npu.calls.count("npu_fused_infer_attention_score") == 5 * 2
    assert "device:linear_residual: kept off" in text


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_w8_model_runs_every_linear_on_the_npu_kernel(dtype, caplog):
    """The core plan of a w8 model: its fp16/bf16 scales reach npu_weight_quant_batchmatmul
    exactly (the lowering quantizes against scales of the compute dtype), so every
    Linear (QKV, output, gate|up, down, LM head) runs there and nothing falls back."""
    model = tiny("llama", seed=3).to(dtype)
    ids, mask = left_padded([6, 3], seed=2)
    want = atb.compile(model, opt_level=1, quantize="w8").generate(
        ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    with use_npu_module(NpuDouble("A2"), stand_in="cpu") as npu, \
            caplog.at_level(logging.INFO, logger="atb"):
        fast = atb.compile(model, opt_level=1, quantize="w8")
        got = fast.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert isinstance(fast.atb_runner, CoreRunner)
    assert torch.equal(got, want)
    # 4 Linears per layer (2 layers) + the LM head, prefill and 3 decode steps
    assert npu.calls.count("npu_weight_quant_batchmatmul") == (4 * 2 + 1) * 4
    assert "Linear: torch_npu kernel skipped" not in caplog.text, caplog.text


def test_compile_on_a_310p_double_falls_back_where_documented():
    """310P: no bf16, no prefill attention op, RoPE only at head_dim 128: those run as
    torch kernels (logged), the decode attention as npu_incre_flash_attention."""
    model = _model("qwen2")
    ids, mask = left_padded([5, 5], seed=9)
    want = atb.compile(model, opt_level=2).generate(ids, attention_mask=mask, max_new_tokens=5,
                                                    do_sample=False)
    with use_npu_module(NpuDouble("310P"), stand_in="cpu") as npu:
        fast = atb.compile(model, opt_level=2)
        got = fast.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, want)
    assert isinstance(fast.atb_runner, CoreRunner)
    # 310P's ATB cache ops take NZ caches: the cache write stays a torch kernel
    assert "_npu_reshape_and_cache" not in npu.calls
    ran = set(npu.calls)
    assert {"npu_rms_norm", "npu_incre_flash_attention"} <= ran, ran
    assert not {"npu_fusion_attention", "npu_rotary_mul", "npu_fused_infer_attention_score"} & ran
