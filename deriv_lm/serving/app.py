"""The HTTP face of `deriv serve`: the OpenAI endpoints over FastAPI, each request checked before it is decoded.

    POST /v1/chat/completions   messages, rendered with the folder's chat template (message text stays text)
    POST /v1/completions        a prompt, as text or token ids
    GET  /v1/models             the one model this server serves
    GET  /health                200 while requests can be served, 503 (and why) otherwise

A request goes through, in order: the Host header (400 unless it names this server), the body's Content-Type
(415 unless JSON), the body limit and its time (413 and 408, before anything is parsed), JSON, the schema of
`protocol.py` (400 naming the field), the model name (404), what this server's mode can honour (400), the
prompt against the context and the vocabulary (400 with the numbers), the limit of requests in flight (429),
and only then the engine. Any other path is 404, any other method 405, in the same error shape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..tokenization.chat_template import ChatTemplateError, render_chat
from .engines import END, Job, JobFailed
from .guard import BODY_SECONDS, ClientGone, Guard, HostCheck, gone, read_json, require_json
from .protocol import ChatRequest, CompletionRequest, RequestError, Sampling, error_body, parse


logger = logging.getLogger("deriv_lm.serve")

DEFAULT_COMPLETION_TOKENS = 16  # the OpenAI API's default max_tokens for /v1/completions


@dataclass
class Served:
    """What the server serves and its limits; built once by `deriv serve`."""

    name: str  # the model's id in requests and replies (never a local path unless the user chose one)
    model: Any
    tokenizer: Any
    engine: Any  # engines.GenerateEngine or engines.BatchingEngine
    max_body_bytes: int = 1 << 20
    max_concurrent_requests: int = 64
    aliases: tuple[str, ...] = ()  # other names a request may use for the same model (the folder as given)
    host: str = "127.0.0.1"  # the address it listens on, and its port: the Host headers it answers
    port: int = 8000
    allowed_hosts: tuple[str, ...] = ()  # more names a Host header may give (--allow-host, for a proxy)
    body_seconds: float = BODY_SECONDS  # the longest a request body may take to arrive (--read-timeout)
    created: int = field(default_factory=lambda: int(time.time()))
    in_flight: int = 0
    # subtle: encoding with `split_special_tokens` flips a flag on the one Rust tokenizer the fast tokenizer wraps
    # (`encode_special_tokens`), so two prompts encoded at once in two threads can read each other's setting: a
    # chat template's role tokens came out as text under load. Prompts are encoded one at a time.
    tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def context(self) -> int:
        return self.model.config.max_position_embeddings

    @property
    def generation(self):
        return self.engine.generation_config

    def eos_ids(self) -> set[int]:
        eos = self.generation.eos_token_id
        return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


# ---- from a validated request to the engine's settings --------------------------------------------------------


def check_model(served: Served, request: Sampling) -> None:
    if request.model is not None and request.model not in (served.name, *served.aliases):
        raise RequestError(
            f"model: this server serves {served.name!r} only, not {request.model!r}",
            param="model",
            status=404,
            code="model_not_found",
        )


def sampling_settings(served: Served, request: Sampling) -> tuple[dict, Any]:
    """The request's GenerationConfig fields and penalty processors; in batching mode, a refusal (400) of any
    setting that differs from the one the whole batch decodes with."""
    folder = served.generation
    greedy = request.temperature == 0 or (request.temperature is None and not folder.do_sample)
    if served.engine.batching:
        _batch_can_honour(served, request, greedy)
        return {}, None
    if greedy:
        sampling = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    else:
        sampling = {"do_sample": True}
        if request.temperature is not None:
            sampling["temperature"] = request.temperature
        if request.top_p is not None:
            sampling["top_p"] = request.top_p
    from ..modeling_deriv.decode_loop import penalty_processors  # the rule, stated once

    return sampling, penalty_processors(request.presence_penalty, request.frequency_penalty) or None


def _batch_can_honour(served: Served, request: Sampling, greedy: bool) -> None:
    """Continuous batching decodes every request with the folder's generation config: refuse what differs."""
    folder = served.generation
    mode = "greedy" if not folder.do_sample else f"temperature {folder.temperature}, top_p {folder.top_p}"
    why = (
        f"this server decodes with continuous batching, which uses one sampling setting for every request "
        f"(the folder's: {mode}); leave it unset, or start deriv serve without --continuous-batching"
    )
    if greedy == folder.do_sample:
        raise RequestError(f"temperature: {why}", param="temperature")
    if folder.do_sample:
        for name in ("temperature", "top_p"):
            value = getattr(request, name)
            if value is not None and value != getattr(folder, name):
                raise RequestError(f"{name}: {why}", param=name)
        if request.seed is not None:
            raise RequestError(f"seed: {why}", param="seed")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name):
            raise RequestError(f"{name}: {why}", param=name)


def chat_prompt(served: Served, request: ChatRequest) -> list[int]:
    """The conversation in the folder's chat template. subtle: `sanitize_control_tokens` keeps a message's text
    as text: a `<eos>` or `<|system|>` typed in a message is characters, only the template writes control tokens."""
    if not served.tokenizer.chat_template:
        raise RequestError(
            "messages: this model has no chat template; use /v1/completions with a prompt", param="messages"
        )
    try:  # subtle: within a budget (render_chat), so a template that would not end cannot hold the lock for good
        with served.tokenizer_lock:
            return render_chat(
                served.tokenizer,
                request.conversation(),
                served.name,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                sanitize_control_tokens=True,
                tokenizer_kwargs={"verbose": False},
            )
    except ChatTemplateError as error:  # the template's own refusal (raise_exception), e.g. roles out of order
        raise RequestError(f"messages: the chat template {error.why}", param="messages") from None


def completion_prompt(served: Served, request: CompletionRequest) -> list[int]:
    """Text as `deriv generate` reads it (literally: a typed `<eos>` is characters), or token ids in range."""
    if isinstance(request.prompt, str):
        with served.tokenizer_lock:
            ids = served.tokenizer(request.prompt, add_special_tokens=False, split_special_tokens=True, verbose=False)
        return ids.input_ids
    vocab = served.model.config.vocab_size
    for i, token in enumerate(request.prompt):
        if not 0 <= token < vocab:
            raise RequestError(
                f"prompt.{i}: token id {token} is out of range: the vocabulary has ids 0 to {vocab - 1}",
                param=f"prompt.{i}",
            )
    return list(request.prompt)


def budget(served: Served, request: Sampling, prompt: list[int], param: str, default: int | None) -> int:
    """How many new tokens the request gets: max_tokens, refused (with the numbers) if the prompt and it do not
    fit the context; unset, the default cut to what fits (finish_reason "length" says when that ended a reply)."""
    context = served.context
    if not prompt:
        raise RequestError(f"{param}: the prompt is empty", param=param)
    if len(prompt) >= context:
        raise RequestError(
            f"{param}: the prompt is {len(prompt)} tokens; the model's context is {context} tokens, which leaves "
            "no room for a reply: shorten it",
            param=param,
            code="context_length_exceeded",
        )
    room = context - len(prompt)
    if request.max_tokens is None:
        return min(default or room, room)
    if request.max_tokens > room:
        raise RequestError(
            f"max_tokens: {request.max_tokens} new tokens do not fit: the prompt is {len(prompt)} tokens and the "
            f"model's context is {context}, so at most {room} can follow it",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return request.max_tokens


# ---- from the engine's tokens to text ----------------------------------------------------------------------------


class Reply:
    """A reply's new tokens as text: decoded incrementally, cut at the first stop sequence, and never showing
    text that might still become part of one (or half a UTF-8 character)."""

    def __init__(self, tokenizer, stops: list[str] | None, eos_ids: set[int]):
        self.tokenizer = tokenizer
        self.stops = stops or []
        self.eos_ids = eos_ids
        self.tokens: list[int] = []
        self.sent = ""  # text already handed out
        self.stopped = False  # a stop sequence ended it

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def add(self, tokens: list[int]) -> str:
        """Take new tokens; the text that can be handed out now."""
        self.tokens += tokens
        text = self.text
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            return self._advance(text[:cut])
        hold = max((len(s) - 1 for s in self.stops), default=0)
        if text.endswith("\ufffd"):  # half of a character whose other bytes are still to come
            hold = max(hold, len(text) - len(text.rstrip("\ufffd")))
        return self._advance(text[: len(text) - hold] if hold else text)

    def finish(self) -> str:
        """The text held back so far, now that no token will follow."""
        if self.stopped:
            return ""
        text = self.text
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            text = text[:cut]
        return self._advance(text)

    def _first_stop(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _advance(self, text: str) -> str:
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""  # nothing new (or the decoding of earlier tokens changed: wait for the end)
        piece, self.sent = text[len(self.sent) :], text
        return piece

    @property
    def finish_reason(self) -> str:
        ended = self.stopped or (self.tokens and self.tokens[-1] in self.eos_ids)
        return "stop" if ended else "length"

    def usage(self, prompt_tokens: int) -> dict:
        n = len(self.tokens)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}


async def run_job(served: Served, job: Job, reply: Reply):
    """Yield the reply's text pieces as the engine decodes; cancel the job when a stop sequence ends it early
    or when the consumer goes away (a client that disconnected)."""
    finished = False
    try:
        while True:
            item = await job.queue.get()
            if item is END:
                finished = True
                break
            if isinstance(item, JobFailed):
                finished = True
                raise item
            piece = reply.add(item)
            if piece:
                yield piece
            if reply.stopped:
                break
        tail = reply.finish()
        if tail:
            yield tail
    finally:
        if not finished:
            served.engine.cancel(job)


# ---- the app ----------------------------------------------------------------------------------------------------


class Endpoint(NamedTuple):
    """What differs between the two generating endpoints."""

    schema: type[Sampling]
    prompt: Callable  # (served, request) -> the prompt's token ids
    prompt_field: str  # the field a prompt that does not fit is blamed on
    kind: str  # the reply's `object`
    prefix: str  # of the reply's id

    def default_tokens(self, served: Served) -> int | None:
        """max_tokens when the request leaves it out: the folder's max_new_tokens for a chat, the OpenAI
        default of 16 for a completion (both then cut to what fits the context)."""
        return DEFAULT_COMPLETION_TOKENS if self.schema is CompletionRequest else served.generation.max_new_tokens


CHAT = Endpoint(ChatRequest, chat_prompt, "messages", "chat.completion", "chatcmpl")
COMPLETION = Endpoint(CompletionRequest, completion_prompt, "prompt", "text_completion", "cmpl")


def build_app(served: Served):
    @asynccontextmanager
    async def lifespan(app):
        watcher = asyncio.create_task(served.engine.watch())  # replaces a batching worker that died
        yield
        watcher.cancel()

    app = FastAPI(title="deriv serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.router.redirect_slashes = False  # `/v1/completions/` is 404, not a redirect built from the Host header
    app.state.served = served

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, error: ClientGone):
        gone(request)
        return Response(status_code=400)  # nobody reads it

    @app.exception_handler(RequestError)
    async def _refused(request: Request, error: RequestError):
        headers = {"Retry-After": "1"} if error.status == 429 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, error: HTTPException):
        if error.status_code == 404:
            message = (
                f"{request.url.path}: no such endpoint (this server has /v1/chat/completions, "
                "/v1/completions, /v1/models and /health)"
            )
        elif error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(error.detail)
        return JSONResponse(
            error_body(message, "invalid_request_error"), status_code=error.status_code, headers=error.headers
        )

    @app.exception_handler(Exception)
    async def _bug(request: Request, error: Exception):
        logger.exception("deriv serve: an unexpected error on %s", request.url.path)
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)

    async def complete(request: Request, endpoint: Endpoint):
        """The checks of the module docstring, in its order, then the engine."""
        require_json(request)
        body = await read_json(request, served.max_body_bytes, served.body_seconds)
        parsed = parse(endpoint.schema, body)
        check_model(served, parsed)
        sampling = sampling_settings(served, parsed)
        prompt = await _in_thread(endpoint.prompt, served, parsed)
        limit = budget(served, parsed, prompt, endpoint.prompt_field, endpoint.default_tokens(served))
        return await _respond(served, parsed, prompt, limit, sampling, endpoint.kind, endpoint.prefix)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, COMPLETION)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(served)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name not in (served.name, *served.aliases):
            raise RequestError(
                f"no model {name!r} here; this server serves {served.name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )
        return _model_card(served)

    @app.get("/health")
    async def health():
        reason = served.engine.alive()
        if reason is not None:
            return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)
        return {"status": "ok", "model": served.name, "in_flight": served.in_flight}

    async def _respond(served, request, prompt, limit, sampling, kind, prefix):
        if served.in_flight >= served.max_concurrent_requests:
            raise RequestError(
                f"the server is at its limit of {served.max_concurrent_requests} requests in flight "
                "(--max-concurrent-requests); retry shortly",
                status=429,
                type="rate_limit_error",
            )
        job = Job(prompt, limit, token_by_token=bool(request.stream or request.stop))
        reply = Reply(served.tokenizer, request.stop, served.eos_ids())
        settings, processors = sampling
        head = {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": served.name,
        }
        chat = kind == "chat.completion"
        echo = getattr(request, "echo", False) and served.tokenizer.decode(prompt, skip_special_tokens=True)
        if not request.stream:
            served.in_flight += 1
            try:
                served.engine.submit(job, settings, request.seed, processors)
                pieces = [piece async for piece in run_job(served, job, reply)]
            except JobFailed as failed:
                raise RequestError(
                    f"{failed}; the request was valid: retry it", status=500, type="server_error"
                ) from None
            finally:
                served.in_flight -= 1
            text = (echo or "") + "".join(pieces)
            choice = {"index": 0, "finish_reason": reply.finish_reason, "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            return {**head, "choices": [choice], "usage": reply.usage(len(prompt))}

        async def events():
            # subtle: the job starts with the stream, so a response that is never sent starts nothing
            chunk = {**head, "object": "chat.completion.chunk" if chat else kind}

            def event(choice: dict | None, **extra) -> str:
                choices = [] if choice is None else [{"index": 0, "logprobs": None, **choice}]
                return f"data: {json.dumps({**chunk, 'choices': choices, **extra})}\n\n"

            def piece_event(text: str, finish: str | None = None) -> str:
                content = {"delta": {"content": text} if text else {}} if chat else {"text": text}
                return event({**content, "finish_reason": finish})

            served.in_flight += 1
            try:
                served.engine.submit(job, settings, request.seed, processors)
                if chat:
                    yield event({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})
                if echo:
                    yield piece_event(echo)
                async for piece in run_job(served, job, reply):
                    yield piece_event(piece)
                yield piece_event("", reply.finish_reason)
                if request.include_usage:
                    yield event(None, usage=reply.usage(len(prompt)))
            except JobFailed as failed:
                failure = error_body(f"{failed}; the request was valid: retry it", "server_error")
                yield f"data: {json.dumps(failure)}\n\n"
            finally:
                served.in_flight -= 1
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return Guard(app, HostCheck(served.host, served.port, served.allowed_hosts), refusal)


def refusal(message: str, code: str) -> dict:
    """The guard's refusals (`guard.Guard`: headers too large, a Host not this server's) in the OpenAI error shape."""
    return error_body(message, "invalid_request_error", code=code)


def _model_card(served: Served) -> dict:
    return {
        "id": served.name,
        "object": "model",
        "created": served.created,
        "owned_by": "deriv",
        "max_model_len": served.context,
    }


async def _in_thread(function, *args):
    return await asyncio.to_thread(function, *args)
