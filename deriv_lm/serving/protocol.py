"""The OpenAI requests `deriv serve` accepts, checked field by field before anything reaches the model.

Each request body is validated against a strict schema (pydantic, `extra="forbid"`): wrong types, values out of
the OpenAI ranges, unknown fields and features this server does not have are refused with HTTP 400 and the
OpenAI error shape, `{"error": {"message", "type", "param", "code"}}`, where `param` names the field
(`messages.1.content`, `temperature`). Nothing is dropped silently: a field the server cannot honour (`n` 2,
`logprobs`, image parts, tools) is refused rather than ignored. The checks that need the model (the prompt's
length against the context, token ids against the vocabulary) happen once the prompt is tokenized, in
`app.py`, with the same error shape.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..arguments import PENALTY_LIMIT, invalid_text


SEED_RANGE = (0, 2**64 - 1)  # what torch.manual_seed takes
MAX_STOPS = 4  # the OpenAI API's limit on `stop` sequences


class RequestError(ValueError):
    """A request the server refuses: the HTTP status and the OpenAI error fields. A ValueError, so that pydantic
    keeps it (and the field it names) when a validator raises it."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Fields of the OpenAI API this server knows and refuses by name, with the reason (an unknown field is refused too).
UNSUPPORTED = {
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "parallel_tool_calls": "tool calling is not supported",
    "response_format": "structured output is not supported",
    "logit_bias": "logit_bias is not supported",
    "top_logprobs": "log probabilities are not returned",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "suffix": "suffix (insertion) is not supported",
}

Temperature = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-PENALTY_LIMIT, le=PENALTY_LIMIT, allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])]
Positive = Annotated[int, Field(ge=1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class Sampling(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: Positive | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Seed | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logprobs: Any = None
    user: str | None = None  # an end-user id for the caller's own records: accepted, not used

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, reason in UNSUPPORTED.items():
                if name in data and data[name] is not None:
                    raise _field_error(name, f"{reason} by deriv serve")
        return data

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("deriv serve returns one choice per request; n must be 1 (send n requests instead)")
        return n

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, stop):
        if stop is None:
            return None
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list):
            raise ValueError(f"give a string or a list of strings, not {json_type(stop)}")
        for i, text in enumerate(stops):
            if not isinstance(text, str):
                raise _field_error(str(i), f"a stop sequence is a string, not {json_type(text)}")
        if stops is not None and not 1 <= len(stops) <= MAX_STOPS:
            raise ValueError(f"give 1 to {MAX_STOPS} stop sequences")
        if stops is not None and any(s == "" for s in stops):
            raise ValueError("a stop sequence must not be empty")
        return stops

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs):
        if logprobs not in (None, False, 0):
            raise ValueError("log probabilities are not returned by deriv serve; leave logprobs unset")
        return None

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise _field_error("stream_options", "stream_options is only allowed with stream: true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """One chat message: a role the chat template knows and text (a string, or text parts)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        if content is None:
            raise ValueError("content is required (tool calls are not supported)")
        if isinstance(content, list):
            for i, part in enumerate(content):
                if not isinstance(part, dict):
                    raise _field_error(str(i), f"a content part is an object, not {json_type(part)}")
                kind = part.get("type")
                if kind != "text":
                    raise _field_error(f"{i}.type", f"only text parts are supported, not {kind!r}")
                if not isinstance(part.get("text"), str):
                    raise _field_error(f"{i}.text", "a text part needs its text as a string")
        return content

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Positive | None = None

    @model_validator(mode="after")
    def _one_budget(self):
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise _field_error("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
            self.max_tokens = self.max_completion_tokens
        return self

    def conversation(self) -> list[dict]:
        """The messages as the chat template reads them (OpenAI's `developer` is the template's `system`)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(Sampling):
    """POST /v1/completions: a prompt as text or as token ids, one per request."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("deriv serve takes one prompt per request; send the others separately")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise ValueError("the prompt is empty")
        return prompt

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, best_of):
        if best_of not in (None, 1):
            raise ValueError("best_of is not supported by deriv serve (only 1)")
        return best_of


def _field_error(param: str, message: str) -> RequestError:
    return RequestError(message, param=param)


def parse(kind: type[Sampling], body: Any) -> Sampling:
    """The request, validated; RequestError (400) naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, not {json_type(body)}")
    found = first_invalid_text(body)
    if found is not None:
        param, why = found
        raise RequestError(f"{param}: not valid text: {why}" if param else f"not valid text: {why}", param=param)
    try:
        return kind.model_validate(body)
    except RequestError:
        raise
    except ValidationError as error:
        raise _first_error(error) from None


def first_invalid_text(value: Any, path: tuple[str, ...] = ()) -> tuple[str | None, str] | None:
    """(the dotted path of, why) the first string of a JSON value, key or value, that is not valid Unicode (JSON's
    `"\\ud800"` decodes to a lone surrogate, which no tokenizer takes), or None."""
    if isinstance(value, str):
        why = invalid_text(value)
        return (".".join(path) or None, why) if why else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = (*path, str(key))
        if isinstance(key, str) and invalid_text(key):
            return ".".join(path) or None, f"a field name: {invalid_text(key)}"
        found = first_invalid_text(item, where)
        if found is not None:
            return found
    return None


def _first_error(error: ValidationError) -> RequestError:
    """pydantic's first error as the OpenAI error: `param` the dotted path, a message without pydantic's URL."""
    first = error.errors(include_url=False)[0]
    path = [str(p) for p in first["loc"] if not is_branch(p)]
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, RequestError):  # raised by a validator, naming the field (below this one, if nested)
        param = ".".join(p for p in [*path, cause.param] if p)
        return RequestError(f"{param}: {cause.message}", param=param)
    param = ".".join(path) or None
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown field (not part of the OpenAI request this server accepts)"
    elif first["type"] == "missing":
        message = "this field is required"
    elif first["type"].endswith("_type"):
        message = f"{message}, not {json_type(first['input'])}"
    elif first["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"):
        message = f"{message}, got {first['input']!r}"[:300]
    return RequestError(f"{param}: {message}" if param else message, param=param)


def is_branch(part) -> bool:
    """A union branch pydantic puts in an error's path (`str`, `list[TextPart]`, `nullable[int]`), not a field
    name (the explorer's bodies are read with it too)."""
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool", "none") or "[" in part or part[:1].isupper()
    )


def json_type(value: Any) -> str:
    """What a JSON value is, for a message: "null", "a boolean", "an array", a short string as itself."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number" if math.isfinite(value) else f"{value}"
    if isinstance(value, str):
        return f"the string {value!r}" if len(value) <= 20 else "a string"
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else type(value).__name__
