"""``atb serve`` through the official ``openai`` client on a real server (127.0.0.1, a
free port): completions and chat, streamed and not, equal ``LLM.generate``;
embeddings equal sentence-transformers' ``encode``; models, metrics, errors."""

import threading
import time

import httpx
import numpy as np
import openai
import pytest

from serve_server import RunningServer

PROMPTS = ["the quick brown fox", "hello world, this is", "one two three four five six"]


def test_models_and_health(server):
    assert httpx.get(server.base + "/health").json() == {"status": "ok"}
    ids = [m.id for m in server.client().models.list()]
    assert ids == ["tiny-llama", "all-MiniLM-L6-v2"]


def test_completions_greedy_equal_llm_generate(server, served):
    c = server.client()
    for p in PROMPTS:
        ref = served.llm.generate_outputs(p, max_new_tokens=12)[0]
        r = c.completions.create(model="tiny-llama", prompt=p, max_tokens=12, temperature=0)
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == ("stop" if ref.finish_reason == "eos" else "length")
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref.token_ids)
        chunks = list(c.completions.create(model="tiny-llama", prompt=p, max_tokens=12,
                                           temperature=0, stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == ref.text
        assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    # several prompts, token-id prompts, n choices: indexed prompt * n + choice
    r = c.completions.create(model="tiny-llama", prompt=PROMPTS[:2], max_tokens=6,
                             temperature=0.9, seed=4, n=2)
    ref = served.llm.generate_outputs([PROMPTS[0]] * 2 + [PROMPTS[1]] * 2, max_new_tokens=6,
                                      temperature=0.9, seed=4)
    assert [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)] == \
        [o.text for o in ref]
    ids = served.llm.tokenizer(PROMPTS[2]).input_ids
    r = c.completions.create(model="tiny-llama", prompt=ids, max_tokens=5, temperature=0)
    assert r.choices[0].text == served.llm.generate(ids, max_new_tokens=5)


def test_chat_greedy_equal_llm_generate_with_the_template(server, served):
    from atb_torch.llm.server.chat import chat_prompt_ids
    from atb_torch.llm.server.protocol import ChatMessage

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPTS[0]}]
    ids = chat_prompt_ids(served.llm.tokenizer, [ChatMessage(**m) for m in msgs])
    assert served.llm.tokenizer.decode(ids) == "system: be brief\nuser: the quick brown fox\n" \
        "assistant:"  # the documented template (this tokenizer has none of its own)
    ref = served.llm.generate_outputs(ids, max_new_tokens=10, logprobs=2)[0]
    c = server.client()
    r = c.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=10,
                                  temperature=0, logprobs=True, top_logprobs=2)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    got = r.choices[0].logprobs.content
    assert [g.logprob for g in got] == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-6)
    assert len(got[0].top_logprobs) == 2
    stream = c.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=10,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_stop_strings_and_penalties_through_the_api(server, served):
    full = served.llm.generate_outputs(PROMPTS[1], max_new_tokens=20, ignore_eos=True)[0].text
    stop = full[6:9]
    c = server.client()
    r = c.completions.create(model="tiny-llama", prompt=PROMPTS[1], max_tokens=20, temperature=0,
                             stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.find(stop)] and r.choices[0].finish_reason == "stop"
    ref = served.llm.generate(PROMPTS[1], max_new_tokens=12, presence_penalty=1.5,
                              frequency_penalty=0.5, repetition_penalty=1.3)
    r = c.completions.create(model="tiny-llama", prompt=PROMPTS[1], max_tokens=12, temperature=0,
                             presence_penalty=1.5, frequency_penalty=0.5,
                             extra_body={"repetition_penalty": 1.3})
    assert r.choices[0].text == ref


def test_embeddings_equal_sentence_transformers_encode(server):
    from atb_torch.llm.bench.encoder import load_minilm
    from atb_torch.llm.bench.models import minilm_path

    texts = ["The cat sits on the mat.", "A fast kernel fuses the attention block.",
             "embeddings " * 40]
    ref = load_minilm(str(minilm_path())).encode(texts, convert_to_numpy=True)
    c = server.client()
    for fmt in ("float", "base64"):  # the openai client asks for base64 unless told
        kw = {"encoding_format": "float"} if fmt == "float" else {}
        r = c.embeddings.create(model="all-MiniLM-L6-v2", input=texts, **kw)
        got = np.array([d.embedding for d in r.data], dtype=np.float64)
        cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
        assert cos.min() >= 0.99999, cos
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # normalized
    assert r.usage.prompt_tokens > len(texts)


def test_malformed_requests_get_4xx_and_serving_goes_on(server):
    url = server.base + "/v1/completions"
    ok = {"model": "tiny-llama", "prompt": "hello", "max_tokens": 3, "temperature": 0}
    cases = [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        ({**ok, "max_tokens": -5}, 400),
        ({**ok, "temperature": "hot"}, 400),
        ({**ok, "n": "2"}, 400),
        ({**ok, "stop": 7}, 400),
        ({**ok, "prompt": [999999]}, 400),  # token id outside the vocabulary
        ({**ok, "model": "gpt-4"}, 404),
        ({**ok, "prompt": "x " * 5_000_000}, 413),  # a 10 MB prompt
        ({**ok, "prompt": "word " * 3000}, 400),  # longer than the model's context
    ]
    for body, status in cases:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(url, timeout=60, **kw)
        assert r.status_code == status, (str(body)[:60], r.text[:200])
        err = r.json()["error"]
        assert err["message"] and err["type"]
    r = httpx.post(server.base + "/v1/chat/completions",
                   json={"model": "tiny-llama", "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="nope", prompt="a", max_tokens=2)
    r = httpx.post(url, json=ok)  # still serving
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None


def test_api_key_loading_503_and_timeout(served):
    from atb_torch.llm.server import build_app

    gate = threading.Event()

    def load():
        gate.wait(30)
        return served

    s = RunningServer(build_app(load, api_key="sesame", timeout_s=0.3))
    try:
        assert httpx.get(s.base + "/health").status_code == 503
        with pytest.raises(openai.InternalServerError) as e:  # 503: loading
            s.client(api_key="sesame").models.list()
        assert e.value.status_code == 503
        gate.set()
        s.wait_ready()
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").models.list()
        assert httpx.get(s.base + "/v1/models").status_code == 401
        assert [m.id for m in s.client(api_key="sesame").models.list()][0] == "tiny-llama"
        t0 = time.perf_counter()
        r = httpx.post(s.base + "/v1/completions", headers={"Authorization": "Bearer sesame"},
                       json={"model": "tiny-llama", "prompt": "a", "max_tokens": 1900,
                             "ignore_eos": True})
        assert r.status_code == 408 and time.perf_counter() - t0 < 5
    finally:
        s.stop()
    deadline = time.monotonic() + 10
    while served.llm.cache.manager.num_used_blocks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert served.llm.cache.manager.num_used_blocks == 0  # the timed-out request's blocks


def test_metrics_count_requests_tokens_and_latencies(server):
    def sample(text, name, **labels):
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        key = f"{name}{{{want}}}" if labels else name
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(key + " "))

    before = httpx.get(server.base + "/metrics").text
    c = server.client()
    r = c.completions.create(model="tiny-llama", prompt=PROMPTS[0], max_tokens=5, temperature=0,
                             extra_body={"ignore_eos": True})
    httpx.post(server.base + "/v1/completions", content=b"{")
    httpx.post(server.base + "/v1/no-such-route", json={})
    after = httpx.get(server.base + "/metrics").text

    def delta(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("atb_requests_total", endpoint="/v1/completions", status="200") == 1
    assert delta("atb_requests_total", endpoint="/v1/completions", status="400") == 1
    assert delta("atb_requests_total", endpoint="other", status="404") == 1
    assert delta("atb_generation_tokens_total") == r.usage.completion_tokens == 5
    assert delta("atb_prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("atb_time_to_first_token_seconds_count") == 1
    assert delta("atb_inter_token_latency_seconds_count") == 4
    assert delta("atb_batch_size_count") >= 5  # a prefill and four decode steps
    assert sample(after, "atb_kv_blocks_total") == served_blocks(server)
    assert 0 <= sample(after, "atb_prefix_cache_hit_rate") <= 1


def served_blocks(server):
    return server.app.state.atb.llm.cache.num_blocks
