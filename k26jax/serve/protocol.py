"""OpenAI's request and response shapes for /v1/completions and /v1/chat/completions, and its error format.

Requests are validated strictly: a field OpenAI does not define is rejected as OpenAI rejects it
("Unrecognized request argument supplied"), and a field it defines that this server does not implement is
rejected by name unless it holds its neutral value (n = 1, penalties 0, echo false, ...). Nothing is ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict

MAX_STOPS = 4


class APIError(Exception):
    """An HTTP error with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param=None, type="invalid_request_error", code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param=None) -> APIError:
    return APIError(400, message, param=param)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "4" or true for an integer is refused, not coerced


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class _Sampling(_Strict):
    """The fields both endpoints share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None
    # OpenAI fields this server does not implement: accepted only at their neutral values (see NEUTRAL)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatRequest(_Sampling):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None


# field -> the values that leave its behaviour neutral (anything else is a 400 naming the field)
NEUTRAL = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "parallel_tool_calls": (),
    "store": (False,),
}
UNSUPPORTED = (
    "presence_penalty frequency_penalty logit_bias echo best_of suffix tools tool_choice parallel_tool_calls "
    "functions function_call response_format modalities audio prediction reasoning_effort web_search_options store "
    "metadata service_tier"
).split()


def parse(model_cls, raw: bytes):
    """The request body -> a validated model, or an APIError 400 naming the first offending field."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"We could not parse the JSON body of your request: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object")
    _refuse_non_text_parts(body.get("messages"))
    try:
        req = model_cls.model_validate(body)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        where, param = ".".join(str(p) for p in err["loc"]), str(err["loc"][0]) if err["loc"] else None
        if err["type"] == "extra_forbidden":
            raise bad_request(f"Unrecognized request argument supplied: {where}", param) from None
        if err["type"] == "missing":
            raise bad_request(f"Missing required parameter: '{where}'", param) from None
        raise bad_request(f"Invalid value for '{where}': {err['msg']}", param) from None
    for name in UNSUPPORTED:
        value = getattr(req, name, None)
        if value is not None and value not in NEUTRAL.get(name, ()):
            raise bad_request(f"'{name}' is not supported by this server", name)
    return req


def _refuse_non_text_parts(messages) -> None:
    """An image, audio or file content part is named as unsupported (a text-only model), not as a type error."""
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        parts = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(parts if isinstance(parts, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise bad_request(
                    f"Invalid value for 'messages.{i}.content.{j}': only text content parts are supported "
                    f"(got type {kind!r})",
                    "messages",
                )


def check_sampling(req: _Sampling) -> dict:
    """Range checks OpenAI makes; returns the engine's sampling values and stream flags."""
    if req.n not in (None, 1):
        raise bad_request("'n' must be 1: this server returns one choice per prompt", "n")
    if req.temperature is not None and not 0 <= req.temperature <= 2:
        raise bad_request(f"Invalid 'temperature': {req.temperature} is outside [0, 2]", "temperature")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise bad_request(f"Invalid 'top_p': {req.top_p} is outside (0, 1]", "top_p")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOPS:
        raise bad_request(f"'stop' takes at most {MAX_STOPS} sequences", "stop")
    if req.stream_options is not None and not req.stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return dict(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        stops=stops,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
    )


def check_logprobs(top: int | None, max_logprobs: int, param: str) -> int | None:
    if top is not None and not 0 <= top <= max_logprobs:
        raise bad_request(f"Invalid '{param}': {top} is outside [0, {max_logprobs}]", param)
    return top


def check_max_tokens(value: int | None, param: str) -> int | None:
    if value is not None and value < 1:
        raise bad_request(f"Invalid '{param}': {value}; it must be at least 1", param)
    return value


# ---- responses -------------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
