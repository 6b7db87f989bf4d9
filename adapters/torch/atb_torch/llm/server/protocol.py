"""The OpenAI API's request bodies (the fields atb serves, checked strictly: a
wrong-typed field is a 400, not a guess) and its error schema.

Unknown fields are ignored, as OpenAI-compatible servers do, so clients that send
newer options still work; fields atb cannot honour (``echo``, ``best_of`` > ``n``,
``logit_bias``, tools) are refused by name rather than silently dropped."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from pydantic import ValidationError

__all__ = ["ApiError", "CompletionRequest", "ChatRequest", "ChatMessage", "EmbeddingRequest",
           "parse_body", "error_body"]

Number = Union[StrictInt, StrictFloat]


class ApiError(Exception):
    """An error answered in OpenAI's schema: ``status`` (400, 401, 404, 408, 413, 429,
    500, 503), ``message``, ``type`` and the offending ``param``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code = param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """``{"error": {...}}`` as OpenAI answers it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Sampling(_Body):
    """Fields shared by completions and chat completions, with the extras vLLM
    accepts too (``top_k``, ``repetition_penalty``, ``ignore_eos``)."""

    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number | None = Field(default=None, ge=0, le=2)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=-1)
    n: StrictInt = Field(default=1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = Field(default=None, ge=0, lt=2**63)
    presence_penalty: Number = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: Number = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: Number = Field(default=1.0, gt=0)
    ignore_eos: StrictBool = False
    logit_bias: dict[str, Number] | None = None
    user: StrictStr | None = None


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False
    best_of: StrictInt | None = Field(default=None, ge=1)
    suffix: StrictStr | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    tools: list[Any] | None = None


class EmbeddingRequest(_Body):
    model: StrictStr
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(default=None, ge=1)
    user: StrictStr | None = None


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """``body`` (JSON bytes) as ``model``; bad JSON or a bad field is an
    :class:`ApiError` 400 naming the field."""
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise ApiError(400, f"the body is not valid JSON: {err['msg']}") from None
        param = str(err["loc"][0]) if err["loc"] else None
        where = ".".join(str(p) for p in err["loc"]) or "body"  # union members included
        given = err.get("input")
        given = repr(given)[:80] if not isinstance(given, dict) else "an object"
        raise ApiError(400, f"{where}: {err['msg']} (given {given})", param=param) from None
