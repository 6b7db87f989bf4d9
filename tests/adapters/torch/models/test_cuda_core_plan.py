"""What ``compile()`` and ``LLM`` run on a CUDA device: the core plan (CoreRunner /
the paged core engine) with the torch backend's CUDA kernels, Triton's where they
take the call.

Without a GPU, CPU tensors stand for CUDA ones (:func:`atbcore.backends.npu.stand_in`)
and the Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
``tests/conftest.py``): the same routing, the same Triton kernels and the same
fallback reasons as on a GPU, checked against the CPU engine's greedy tokens. With a
GPU the same tests run on CUDA tensors (``benchmarks/core_cuda_check.py`` adds the
CUDA-graph capture and timings)."""

import collections
import contextlib
import importlib
import logging
import sys
from pathlib import Path

import pytest
import torch

import atb_torch as atb
from atb_torch.models.core_runner import CoreRunner
from atbcore.backends.npu import kernel_device, stand_in
from atbcore.backends.triton import interpreting

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_models import left_padded, tiny  # noqa: E402

# the Triton launch functions the torch backend's CUDA kernels call
LAUNCHES = {"norm": ("rms_norm",), "rope_cache": ("rope_kv_cache", "rope"),
            "paged": ("paged_decode_attention",),
            "paged_prefill": ("paged_prefill_attention",), "activation": ("gated",),
            "prefill": ("prefill_attention",)}


@pytest.fixture
def on_cuda():
    """``(device, context)``: where the model goes, and the context that makes its
    tensors CUDA tensors to the kernels (the stand-in without a GPU)."""
    if interpreting():
        return "cpu", stand_in("cuda")
    return "cuda", contextlib.nullcontext()


@pytest.fixture
def triton_calls(monkeypatch):
    """Counts of the Triton launches made from now on."""
    calls = collections.Counter()
    for mod, names in LAUNCHES.items():
        m = importlib.import_module(f"atbcore.backends.triton.{mod}")
        for name in names:
            def count(*a, _f=getattr(m, name), _n=f"{mod}.{name}", **kw):
                calls[_n] += 1
                return _f(*a, **kw)
            monkeypatch.setattr(m, name, count)
    return calls


def _skipped(caplog):
    return sorted({r.getMessage() for r in caplog.records if "skipped" in r.getMessage()})


def test_the_stand_in_routes_cpu_tensors_to_the_cuda_kernels():
    assert kernel_device("cpu") == "cpu"
    with stand_in("cuda"):
        assert kernel_device("cpu") == "cuda" and kernel_device("npu") == "npu"
    assert kernel_device("cpu") == "cpu"


def test_compile_on_cuda_runs_the_core_plan_on_the_triton_kernels(on_cuda, triton_calls,
                                                                   caplog):
    model = tiny("llama", seed=3).to(torch.float16)
    ids, mask = left_padded([7, 4], seed=5)
    want = atb.compile(model, opt_level=2).generate(ids, attention_mask=mask,
                                                    max_new_tokens=6, do_sample=False)
    device, ctx = on_cuda
    with ctx, caplog.at_level(logging.INFO, logger="atb"):
        fast = atb.compile(model.to(device), opt_level=2)
        got = fast.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=6,
                            do_sample=False)
    model.to("cpu")
    assert isinstance(fast.atb_runner, CoreRunner)
    assert torch.equal(got.cpu(), want)
    # 6 forwards (the prompt, 5 decode steps) x 2 layers: per layer the RoPE + cache
    # write and the attention; the norms before QKV and the MLP, and the final one
    assert triton_calls == {"rope_cache.rope_kv_cache": 12, "norm.rms_norm": 30,
                            "paged_prefill.paged_prefill_attention": 2,
                            "paged.paged_decode_attention": 10}, triton_calls
    # the only kernels that step aside are the CPU's own C kernels
    assert not [m for m in _skipped(caplog) if "triton kernel skipped" in m], _skipped(caplog)


def test_llm_on_cuda_serves_from_the_paged_core_plan(on_cuda, triton_calls, caplog):
    from atb_torch.llm import LLM

    model = tiny("qwen2", seed=3).to(torch.float16)
    prompts = [[5, 17, 33, 9, 81], [44, 12], [7, 7, 100, 3, 19, 250, 61]]
    with LLM(model, max_batch_size=4, block_size=16, num_blocks=16) as cpu:
        want = [o.token_ids for o in cpu.generate_outputs(prompts, max_new_tokens=5,
                                                          ignore_eos=True)]
    device, ctx = on_cuda
    with ctx, caplog.at_level(logging.INFO, logger="atb"):
        with LLM(model.to(device), device=device, max_batch_size=4, block_size=16,
                 num_blocks=16) as llm:
            got = [o.token_ids for o in llm.generate_outputs(prompts, max_new_tokens=5,
                                                             ignore_eos=True)]
            text = llm.explain()
    model.to("cpu")
    assert got == want
    assert "PagedAttention" in text
    # one prefill step (3 prompts), 4 decode steps, 2 layers
    assert triton_calls["rope_cache.rope_kv_cache"] == 10
    assert triton_calls["paged_prefill.paged_prefill_attention"] == 2
    assert triton_calls["paged.paged_decode_attention"] == 8
    assert not [m for m in _skipped(caplog) if "triton kernel skipped" in m], _skipped(caplog)


def test_opt_level_3_captures_decode_steps_on_cuda_only():
    """opt_level 3: the core GraphOp captures its decode steps as CUDA graphs on a CUDA
    device (checked on a GPU by benchmarks/core_cuda_check.py); elsewhere it runs as
    opt_level 2."""
    model = tiny("llama", seed=3)
    on = CoreRunner.from_hf(model, opt_level=3, device=torch.device("cuda"))
    assert on.op.cuda_graph is True
    assert CoreRunner.from_hf(model, opt_level=2, device=torch.device("cuda")).op.cuda_graph \
        is False
    assert atb.compile(model, opt_level=3).atb_runner.op.cuda_graph is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: decode steps captured "
                    "as CUDA graphs (what they run is checked above through the stand-in)")
def test_llm_decode_steps_captured_on_cuda_equal_cpu():
    from atb_torch.llm import LLM

    model = tiny("llama", seed=3).to(torch.float16)
    prompts = [[5, 17, 33, 9, 81], [44, 12]]
    with LLM(model, max_batch_size=4, block_size=16, num_blocks=16) as cpu:
        want = [o.token_ids for o in cpu.generate_outputs(prompts, max_new_tokens=8,
                                                          ignore_eos=True)]
    with LLM(model.cuda(), device="cuda", opt_level=3, max_batch_size=4, block_size=16,
             num_blocks=16) as gpu:
        got = [o.token_ids for o in gpu.generate_outputs(prompts, max_new_tokens=8,
                                                         ignore_eos=True)]
        form = gpu.decoder._in_place
    assert got == want
    assert form.cuda_graph and form._captured  # decode steps replayed a captured graph
