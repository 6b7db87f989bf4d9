"""Fixtures of the LLM tests: one tiny local checkpoint per session, the LLM on it, and
Hugging Face's own model and tokenizer loaded from the same directory (the oracle)."""

import pytest

from llm_checkpoint import build_checkpoint


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def llm(ckpt):
    from atb_torch.llm import LLM

    return LLM(ckpt)


@pytest.fixture(scope="session")
def hf(ckpt):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True, use_safetensors=True)
    return model.eval(), AutoTokenizer.from_pretrained(ckpt, local_files_only=True)
