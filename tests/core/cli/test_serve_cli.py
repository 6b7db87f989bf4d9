"""``atb serve`` on the command line: bad arguments are one line and exit status 2
before anything heavy loads; with no ``--model`` the real command serves the embedded
default model (MiniLM's tokenizer) to the openai client."""

import socket
import subprocess
import sys
import textwrap
import time

import pytest

HEAVY = ("numpy", "torch", "transformers", "fastapi", "uvicorn")


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent/atb-model"], "--model /nonexistent/atb-model: no such folder"),
    (["--port", "70000"], "--port must be in 0..65535, given 70000"),
    (["--max-queue", "0"], "--max-queue must be >= 1, given 0"),
    (["--timeout", "0"], "--timeout must be > 0, given 0.0"),
    (["--api-key", ""], "--api-key must not be empty"),
    (["--embedding-model", "/nonexistent/st"], "--embedding-model /nonexistent/st: no such"),
])
def test_serve_checks_its_input_before_importing_anything_heavy(argv, message):
    code = textwrap.dedent(f"""
        import sys
        from atbcore.cli.main import main
        rc = main({["serve", *argv]!r})
        print("RC", rc)
        print("LOADED", sorted(m for m in {HEAVY!r} if m in sys.modules))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "RC 2" in r.stdout and "LOADED []" in r.stdout, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atb serve: ") and message in lines[0]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_atb_serve_default_model_answers_the_openai_client():
    import httpx
    import openai

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "atb", "serve", "--port", str(port),
                             "--embedding-model", "none", "--api-key", "k"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() - t0 < 180, "atb serve did not become ready"
            time.sleep(0.2)
        c = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)
        assert [m.id for m in c.models.list()] == ["atb-default"]
        r = c.chat.completions.create(model="atb-default", max_tokens=6, temperature=0,
                                      messages=[{"role": "user", "content": "Hello there"}])
        assert r.choices[0].message.content and r.usage.completion_tokens >= 1
        assert r.choices[0].finish_reason in ("stop", "length")
    finally:
        proc.terminate()
        proc.wait(30)
