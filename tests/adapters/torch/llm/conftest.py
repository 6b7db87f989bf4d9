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


class RunningServer:
    """An ``atb serve`` app running on a thread, on 127.0.0.1 and a free port."""

    def __init__(self, app):
        from atb_torch.llm.server import start_in_thread

        self.app = app
        self.server, self.port, self.thread = start_in_thread(app)
        self.base = f"http://127.0.0.1:{self.port}"

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key=kw.pop("api_key", "none"),
                             max_retries=0, timeout=60, **kw)

    def wait_ready(self, timeout=120):
        import time

        import httpx

        t0 = time.monotonic()
        while httpx.get(self.base + "/health").status_code != 200:
            assert time.monotonic() - t0 < timeout, "the server did not become ready"
            time.sleep(0.05)
        return self

    def metric(self, name):
        """The value of an unlabelled sample of /metrics."""
        import httpx

        for line in httpx.get(self.base + "/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


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
