"""The ``atb serve`` application: OpenAI's HTTP API over an :class:`~..LLM` (and an
:class:`~.embeddings.Embedder`).

Why FastAPI on uvicorn: they are the standard, well-kept ASGI pair (vLLM's and
SGLang's OpenAI servers use them too), asyncio holds thousands of idle streaming
connections at no cost while the one engine thread computes, starlette's
``StreamingResponse`` cancels a stream's task when its client goes away (which is
how a disconnect frees KV blocks), and uvicorn handles HTTP/1.1 keep-alive, chunked
bodies and graceful shutdown. Bodies are parsed here, not by FastAPI's
dependency injection, so every malformed request gets OpenAI's error schema (400)
rather than FastAPI's 422 layout.

The model loads on a thread after the server starts listening: ``/health`` and the
API answer 503 until it is ready."""

from __future__ import annotations

import hmac
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import FastAPI
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from .generation import complete
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .protocol import ApiError, ChatRequest, CompletionRequest, EmbeddingRequest, parse_body

__all__ = ["Served", "ServerState", "build_app", "MAX_BODY_BYTES"]

log = logging.getLogger("atb.serving")

MAX_BODY_BYTES = 4 * 2**20  # larger bodies are refused (413) before they are parsed
_ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/embeddings")


@dataclass
class Served:
    """What a server serves: ``llm`` under ``model_name``, ``embedder`` (optional)."""

    llm: Any
    model_name: str
    embedder: Any = None


@dataclass
class ServerState:
    """The server's settings and what it serves once loaded."""

    api_key: str | None = None
    max_queue: int = 256
    timeout_s: float = 600.0
    max_body_bytes: int = MAX_BODY_BYTES
    served: Served | None = None
    load_error: str | None = None
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    handles: list = field(default_factory=list)  # of requests admitted, until they end

    @property
    def in_flight(self) -> int:
        """HTTP requests whose sequences are not all finished (a stream whose client
        vanished before it started still counts until its sequences end)."""
        self.handles = [h for h in self.handles
                        if any(r.finish_reason is None for r in h.requests)]
        return len(self.handles)

    @property
    def llm(self) -> Any:
        return self.served.llm

    @property
    def model_name(self) -> str:
        return self.served.model_name


def build_app(load: Callable[[], Served], *, api_key: str | None = None, max_queue: int = 256,
              timeout_s: float = 600.0, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The ASGI app; ``load()`` runs on a thread at start-up and returns what to serve."""
    state = ServerState(api_key=api_key, max_queue=max_queue, timeout_s=timeout_s,
                        max_body_bytes=max_body_bytes)

    def loader() -> None:
        try:
            served = load()
            state.metrics.attach(served.llm)
            state.served = served
            log.warning("atb serve: %s ready", served.model_name)
        except Exception as e:  # reported by /health and every API call
            log.exception("atb serve: loading the model failed")
            state.load_error = f"{type(e).__name__}: {e}"

    async def lifespan(app: FastAPI):  # noqa: ANN202
        threading.Thread(target=loader, name="atb-load", daemon=True).start()
        yield
        if state.served is not None:
            if state.served.embedder is not None:
                state.served.embedder.close()

    app = FastAPI(title="atb serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.atb = state

    @app.exception_handler(ApiError)
    async def api_error(_: HttpRequest, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.middleware("http")
    async def guard(request: HttpRequest, call_next: Any) -> Response:
        path = request.url.path
        try:
            if path.startswith("/v1/"):
                _authorize(state, request)
            response = await call_next(request)
        except ApiError as e:
            response = JSONResponse(e.body(), status_code=e.status)
        if path.startswith("/v1/"):  # known routes only: a label per random path would grow
            endpoint = path if path in _ENDPOINTS else "other"
            state.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health() -> Response:
        if state.load_error:
            return JSONResponse({"status": "error", "error": state.load_error}, status_code=500)
        if state.served is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        served = _ready(state)
        names = [served.model_name] + ([served.embedder.name] if served.embedder else [])
        now = int(time.time())
        return JSONResponse({"object": "list", "data": [
            {"id": n, "object": "model", "created": now, "owned_by": "atb"} for n in names]})

    @app.post("/v1/completions")
    async def completions(request: HttpRequest) -> Response:
        return await _generate(state, request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HttpRequest) -> Response:
        return await _generate(state, request, ChatRequest)

    @app.post("/v1/embeddings")
    async def embeddings(request: HttpRequest) -> Response:
        served = _ready(state)
        req = parse_body(EmbeddingRequest, await _body(state, request))
        if served.embedder is None or req.model != served.embedder.name:
            raise _unknown_model(req.model, served.embedder.name if served.embedder else None)
        return JSONResponse(await served.embedder.create(req))

    return app


def _authorize(state: ServerState, request: HttpRequest) -> None:
    if state.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), state.api_key.encode()):
        raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                       type="authentication_error", code="invalid_api_key")


def _ready(state: ServerState) -> Served:
    if state.load_error:
        raise ApiError(500, f"the model failed to load: {state.load_error}", type="server_error")
    if state.served is None:
        raise ApiError(503, "the model is loading; retry shortly", type="service_unavailable")
    return state.served


async def _body(state: ServerState, request: HttpRequest) -> bytes:
    """The request body, refused with 413 past ``max_body_bytes`` (read in chunks, so a
    huge body is never held whole)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > state.max_body_bytes:
        raise _too_large(state, int(declared))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > state.max_body_bytes:
            raise _too_large(state, size)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(state: ServerState, size: int) -> ApiError:
    return ApiError(413, f"the body has {size} bytes or more, this server takes at most "
                    f"{state.max_body_bytes}", code="request_too_large")


def _unknown_model(name: str, served: str | None) -> ApiError:
    return ApiError(404, f"the model {name!r} does not exist here (served: {served!r})",
                    param="model", code="model_not_found")


async def _generate(state: ServerState, request: HttpRequest, kind: type) -> Response:
    served = _ready(state)
    req = parse_body(kind, await _body(state, request))
    if req.model != served.model_name:
        raise _unknown_model(req.model, served.model_name)
    if state.in_flight >= state.max_queue:
        raise ApiError(429, f"the server holds {state.in_flight} requests, its limit "
                       f"(--max-queue); retry later", type="rate_limit_error",
                       code="queue_full")
    return await complete(state, request, req)
