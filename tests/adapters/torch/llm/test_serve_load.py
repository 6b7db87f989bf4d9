"""``atb serve`` under load: 64 concurrent streaming clients with mixed settings all
complete with their serial outputs, KV blocks come back, disconnecting clients free
theirs, a full queue answers 429."""

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from serve_server import RunningServer

WORDS = "the quick brown fox jumps over lazy dog hello world one two three numbers".split()


def wait_for(cond, timeout=20.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.02)


def job(k, rng):
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    kw = dict(max_tokens=rng.randint(2, 14), temperature=0.0, seed=k)
    if k % 3 == 1:
        kw.update(temperature=0.7, top_p=0.9)
    if k % 4 == 2:
        kw.update(presence_penalty=0.8, extra_body={"top_k": 20, "repetition_penalty": 1.2})
    if k % 5 == 3:
        kw.update(stop=["e"])
    return "chat" if k % 2 else "completion", prompt, kw


def test_64_concurrent_streaming_clients_equal_serial(server, served):
    rng = random.Random(0)
    jobs = [job(k, rng) for k in range(64)]
    barrier = threading.Barrier(64)

    def client(j):
        kind, prompt, kw = j
        c = server.client()
        barrier.wait(30)
        if kind == "chat":
            s = c.chat.completions.create(model="tiny-llama", stream=True,
                                          messages=[{"role": "user", "content": prompt}], **kw)
            chunks = list(s)
            return ("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices),
                    chunks[-1].choices[0].finish_reason)
        chunks = list(c.completions.create(model="tiny-llama", prompt=prompt, stream=True, **kw))
        return "".join(ch.choices[0].text for ch in chunks), chunks[-1].choices[0].finish_reason

    t0 = time.perf_counter()
    with ThreadPoolExecutor(64) as pool:
        got = list(pool.map(client, jobs))
    elapsed = time.perf_counter() - t0
    assert all(finish in ("stop", "length") for _, finish in got)
    # each one alone, one after another, through the server (the same settings)
    c = server.client()
    for j, (text, _) in zip(jobs, got):
        kind, prompt, kw = j
        if kind == "chat":
            r = c.chat.completions.create(model="tiny-llama",
                                          messages=[{"role": "user", "content": prompt}], **kw)
            assert text == r.choices[0].message.content
        else:
            r = c.completions.create(model="tiny-llama", prompt=prompt, **kw)
            assert text == r.choices[0].text
    # greedy completions equal LLM.generate on the same prompt
    for (kind, prompt, kw), (text, _) in zip(jobs, got):
        if kind == "completion" and set(kw) == {"max_tokens", "temperature", "seed"}:
            assert text == served.llm.generate(prompt, max_new_tokens=kw["max_tokens"])
    wait_for(lambda: server.metric("atb_kv_blocks_used") == 0)
    assert server.metric("atb_requests_running") == 0
    assert server.metric("atb_batch_size_sum") > server.metric("atb_batch_size_count")  # batched
    assert elapsed < 60


def read_first_chunk(base, body):
    """Open a stream, read its first token chunk, then drop the connection."""
    with httpx.Client(base_url=base, timeout=30) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    return


def test_disconnecting_clients_free_their_blocks(server, served):
    generated = server.metric("atb_generation_tokens_total")
    body = {"model": "tiny-llama", "prompt": "one two three four five", "max_tokens": 1800,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with ThreadPoolExecutor(10) as pool:
        list(pool.map(lambda _: read_first_chunk(server.base, body), range(10)))
    wait_for(lambda: server.metric("atb_kv_blocks_used") == 0)
    wait_for(lambda: server.metric("atb_requests_running") == 0)
    # they were cancelled, not run to their 1800 tokens
    assert server.metric("atb_generation_tokens_total") - generated < 10 * 1800 / 2
    r = server.client().completions.create(model="tiny-llama", prompt="hello", max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_full_queue_answers_429(served):
    from atb_torch.llm.server import build_app

    s = RunningServer(build_app(lambda: served, max_queue=2)).wait_ready()
    body = {"model": "tiny-llama", "prompt": "a b c", "max_tokens": 1800, "stream": True,
            "ignore_eos": True}
    try:
        with httpx.Client(base_url=s.base, timeout=30) as h1, \
                httpx.Client(base_url=s.base, timeout=30) as h2:
            with h1.stream("POST", "/v1/completions", json=body) as r1, \
                    h2.stream("POST", "/v1/completions", json=body) as r2:
                assert r1.status_code == r2.status_code == 200
                with pytest.raises(openai.RateLimitError) as e:
                    s.client().completions.create(model="tiny-llama", prompt="x", max_tokens=2)
                assert e.value.status_code == 429
        wait_for(lambda: served.llm.cache.manager.num_used_blocks == 0)
        r = s.client().completions.create(model="tiny-llama", prompt="x", max_tokens=2)
        assert r.choices  # room again once the streams went away
    finally:
        s.stop()
