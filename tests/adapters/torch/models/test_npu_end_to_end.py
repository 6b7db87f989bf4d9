"""``compile()`` and ``LLM`` end to end on the NPU kernels, through the torch_npu
conformance double: CPU tensors stand for NPU ones (``use_npu_module(...,
stand_in="cpu")``), so every op with an NPU kernel runs torch_npu's documented call
(validated by the double) and the C CPU kernels step aside. The greedy tokens must
equal the CPU backend's on the same seeded tiny Llama and Qwen2 (and Mistral, whose
sliding window the decode attention folds into its mask)."""

import sys
from pathlib import Path

import pytest
import torch

import atb_torch as atb
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
    assert torch.equal(got, want)
    ran = set(npu.calls)
    assert {"npu_rms_norm", "npu_add_rms_norm", "npu_rotary_mul", "npu_swiglu",
            "npu_fusion_attention", "npu_fused_infer_attention_score"} <= ran, ran
    # the decode plan's attention: one fused inference call per layer and step
    assert npu.calls.count("npu_fused_infer_attention_score") == 2 * 7


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_llm_through_the_double_equals_cpu(arch):
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
    assert got == want
    ran = set(npu.calls)
    assert {"npu_rms_norm", "npu_add_rms_norm", "npu_rotary_mul", "npu_fusion_attention",
            "_npu_reshape_and_cache", "npu_fused_infer_attention_score"} <= ran, ran


def test_w8_linear_runs_on_the_npu_kernel():
    model = _model("llama")
    ids, mask = left_padded([6], seed=2)
    want = atb.compile(model, opt_level=1, quantize="w8").generate(
        ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    with use_npu_module(NpuDouble("A2"), stand_in="cpu") as npu:
        got = atb.compile(model, opt_level=1, quantize="w8").generate(
            ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)
    assert "npu_weight_quant_batchmatmul" in npu.calls
