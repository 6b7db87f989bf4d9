"""A real ``atb serve`` app for the server tests (its own module name: CI's oldest-
transformers step collects test files from several directories in one run, where
``from conftest import ...`` would find another directory's conftest)."""


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
