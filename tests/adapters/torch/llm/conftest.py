"""Fixtures of the LLM tests: one tiny local checkpoint per session, the LLM on it, and
Hugging Face's own model and tokenizer loaded from the same directory (the oracle)."""

import pytest

from llm_checkpoint import build_checkpoint
from serve_server import RunningServer


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


@pytest.fixture(scope="session")
def served(ckpt):
    """What the test servers serve: a LLM of its own on the tiny checkpoint (the
    server hooks its engine) and all-MiniLM-L6-v2 compiled by atb."""
    from atb_torch.llm import LLM
    from atb_torch.llm.bench.models import minilm_path
    from atb_torch.llm.server import Embedder, Served

    return Served(LLM(ckpt, max_batch_size=32), "tiny-llama",
                  Embedder.load(minilm_path(), "all-MiniLM-L6-v2"))


@pytest.fixture(scope="session")
def server(served):
    from atb_torch.llm.server import build_app

    s = RunningServer(build_app(lambda: served, max_queue=128)).wait_ready()
    yield s
    s.stop()
