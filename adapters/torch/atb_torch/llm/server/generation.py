"""``/v1/completions`` and ``/v1/chat/completions``: one HTTP request becomes one
submission to the engine loop (every prompt times ``n`` choices, each with the
request's sampling), whose events are awaited in asyncio (:class:`~..loop.AsyncSink`)
and answered as one JSON body or as server-sent events.

A request ends early when its client disconnects (streamed: the response task is
cancelled; not streamed: the connection is polled while waiting) or when it runs past
the server's timeout; either way its sequences are cancelled and their KV blocks
freed at the engine's next step."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from atbcore.errors import AtbError

from ..loop import AsyncSink, EngineClosedError, RequestHandle
from ..request import Request
from ..sampling import SamplingConfig, TokenLogprob
from .chat import chat_prompt_ids
from .protocol import ApiError, ChatRequest, CompletionRequest

__all__ = ["complete"]

_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}
_POLL_S = 0.25  # how often a waiting non-streamed request checks its connection


def _sampling(req: CompletionRequest | ChatRequest, logprobs: int | None) -> SamplingConfig:
    for name in ("echo", "suffix", "tools"):
        if getattr(req, name, None):
            raise ApiError(400, f"{name}: not supported by atb serve", param=name)
    if req.logit_bias:
        raise ApiError(400, "logit_bias: not supported by atb serve", param="logit_bias")
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != req.n:
        raise ApiError(400, "best_of: only best_of == n is supported", param="best_of")
    seed = req.seed if req.seed is not None else secrets.randbelow(2**63)
    try:
        return SamplingConfig(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=max(req.top_k or 0, 0), top_p=1.0 if req.top_p is None else req.top_p,
            seed=seed, repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            logprobs=logprobs)
    except AtbError as e:
        raise ApiError(400, str(e)) from e


def _prompts(state: Any, req: CompletionRequest | ChatRequest) -> list[list[int]]:
    llm = state.llm
    if isinstance(req, ChatRequest):
        return [chat_prompt_ids(llm.tokenizer, req.messages)]
    p = req.prompt
    items = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    if not items:
        raise ApiError(400, "prompt: at least one prompt", param="prompt")
    if any(isinstance(x, str) for x in items) and llm.tokenizer is None:
        raise ApiError(400, "prompt: this model has no tokenizer; send token ids", param="prompt")
    try:
        return [llm.encode(x) for x in items]
    except AtbError as e:
        raise ApiError(400, f"prompt: {e}", param="prompt") from e


def _max_tokens(state: Any, req: CompletionRequest | ChatRequest, prompts: list[list[int]]) -> int:
    asked = getattr(req, "max_completion_tokens", None) or req.max_tokens
    room = None
    if state.llm.max_model_len is not None:
        room = state.llm.max_model_len - max(len(p) for p in prompts)
        if room < 1:
            raise ApiError(400, f"prompt: {max(len(p) for p in prompts)} tokens, this model's "
                           f"context is {state.llm.max_model_len}", param="prompt")
    if asked is not None:
        return asked
    default = 16 if isinstance(req, CompletionRequest) else None  # OpenAI's defaults
    return min(x for x in (default, room, 4096) if x is not None)


async def complete(state: Any, http: HttpRequest,
                   req: CompletionRequest | ChatRequest) -> Response:
    """Answer one (chat) completion request (``state``: the server's
    :class:`~.app.ServerState`)."""
    t0 = time.perf_counter()
    chat = isinstance(req, ChatRequest)
    lp = (req.top_logprobs or 0) if chat and req.logprobs else (None if chat else req.logprobs)
    cfg = _sampling(req, lp)
    prompts = _prompts(state, req)
    max_tokens = _max_tokens(state, req, prompts)
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    try:
        handle = state.llm.submit(prompts, cfg, max_tokens, stop, req.ignore_eos, req.n,
                                  sink=AsyncSink(asyncio.get_running_loop()))
    except EngineClosedError as e:
        raise ApiError(503, str(e), type="service_unavailable") from e
    except AtbError as e:
        raise ApiError(400, str(e)) from e
    state.handles.append(handle)  # counts against --max-queue until its sequences end
    state.metrics.prompt_tokens.inc(sum(map(len, prompts)))
    meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "created": int(time.time()), "model": state.model_name}
    events = _events(state, http, handle, t0, streamed=req.stream)
    if req.stream:
        usage = req.stream_options is not None and req.stream_options.include_usage
        body = _sse(state, handle, events, meta, chat, prompts, usage)
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    async for _ in events:
        pass
    failed = [r for r in handle.requests if r.finish_reason == "error"]
    if failed:
        raise ApiError(400, failed[0].error or "the request failed")
    return JSONResponse(_body(state, handle, meta, chat, prompts))


async def _events(state: Any, http: HttpRequest, handle: RequestHandle, t0: float,
                  streamed: bool) -> AsyncIterator[tuple[Request, Any]]:
    """The handle's events, with metrics, the timeout and (not streamed) the
    disconnect check; cancels whatever is unfinished when it ends."""
    deadline = t0 + state.timeout_s
    last: dict[int, float] = {}
    getter: asyncio.Future | None = None
    try:
        while True:
            if getter is None:
                getter = asyncio.ensure_future(handle.aget())
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise ApiError(408, f"the request ran past the server's timeout of "
                               f"{state.timeout_s:g} s", type="timeout_error")
            done, _ = await asyncio.wait({getter}, timeout=min(remaining, _POLL_S))
            if not done:
                if not streamed and await http.is_disconnected():
                    return
                continue
            item, getter = getter.result(), None
            if item is None:
                return
            r, ev = item
            now = time.perf_counter()
            if ev.token_ids:
                state.metrics.generation_tokens.inc(len(ev.token_ids))
                if id(r) in last:
                    gap = (now - last[id(r)]) / len(ev.token_ids)
                    for _ in ev.token_ids:
                        state.metrics.itl.observe(gap)
                else:
                    state.metrics.ttft.observe(now - t0)
                last[id(r)] = now
            yield r, ev
    except EngineClosedError as e:
        raise ApiError(503, str(e), type="service_unavailable") from e
    finally:
        if getter is not None and not getter.done():
            getter.cancel()
        if not handle.finished:
            state.llm.cancel(handle, wait=False)


def _logprobs(tok: Any, lps: list[TokenLogprob], chat: bool, offset: int = 0) -> dict | None:
    if not lps:
        return None

    def piece(t: int) -> str:
        return tok.decode([t]) if tok is not None else str(t)

    if chat:
        return {"content": [{"token": piece(x.token), "logprob": x.logprob,
                             "bytes": list(piece(x.token).encode()),
                             "top_logprobs": [{"token": piece(t), "logprob": v,
                                               "bytes": list(piece(t).encode())}
                                              for t, v in x.top]} for x in lps]}
    tokens = [piece(x.token) for x in lps]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [{piece(t): v for t, v in x.top} for x in lps],
            "text_offset": offsets}


def _usage(prompts: list[list[int]], handle: RequestHandle) -> dict[str, int]:
    p = sum(map(len, prompts))
    c = sum(len(r.output) for r in handle.requests)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _body(state: Any, handle: RequestHandle, meta: dict, chat: bool,
          prompts: list[list[int]]) -> dict[str, Any]:
    tok = state.llm.tokenizer
    choices = []
    for r in sorted(handle.requests, key=lambda r: r.index):
        lps = _logprobs(tok, r.logprobs, chat) if r.sampling.logprobs is not None else None
        finish = _FINISH.get(r.finish_reason or "", r.finish_reason)
        if chat:
            choices.append({"index": r.index, "finish_reason": finish, "logprobs": lps,
                            "message": {"role": "assistant", "content": r.detok.text}})
        else:
            choices.append({"index": r.index, "text": r.detok.text, "finish_reason": finish,
                            "logprobs": lps})
    return {**meta, "object": "chat.completion" if chat else "text_completion",
            "choices": choices, "usage": _usage(prompts, handle)}


def _sse_line(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _sse(state: Any, handle: RequestHandle, events: AsyncIterator, meta: dict,
               chat: bool, prompts: list[list[int]], usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per request step, ``[DONE]`` at the end; an error
    after the headers went out is sent as an ``{"error": ...}`` event."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    tok = state.llm.tokenizer
    offsets = {r.index: 0 for r in handle.requests}

    def chunk(choices: list[dict], **extra: Any) -> str:
        return _sse_line({**meta, "object": kind, "choices": choices, **extra})

    try:
        if chat:
            yield chunk([{"index": r.index, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None} for r in handle.requests])
        async for r, ev in events:
            if ev.finish_reason == "error":
                yield _sse_line({"error": {"message": ev.error, "type": "invalid_request_error",
                                           "param": None, "code": None}})
                continue
            if not ev.text and not ev.finished and not ev.logprobs:
                continue  # text held back (a possible stop string, a partial character)
            lps = _logprobs(tok, ev.logprobs or [], chat, offsets[r.index])
            offsets[r.index] += len(ev.text)
            finish = _FINISH.get(ev.finish_reason, ev.finish_reason) if ev.finished else None
            if chat:
                delta = {"content": ev.text} if ev.text or not ev.finished else {}
                yield chunk([{"index": r.index, "delta": delta, "logprobs": lps,
                              "finish_reason": finish}])
            else:
                yield chunk([{"index": r.index, "text": ev.text, "logprobs": lps,
                              "finish_reason": finish}])
        if usage:
            yield chunk([], usage=_usage(prompts, handle))
    except ApiError as e:
        yield _sse_line(e.body())
    except Exception as e:  # the engine failed mid-stream: say so in the stream
        yield _sse_line({"error": {"message": f"{type(e).__name__}: {e}", "type": "server_error",
                                   "param": None, "code": None}})
    yield "data: [DONE]\n\n"
