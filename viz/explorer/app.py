"""The HTTP face of `deriv explore`: the page, and a JSON API over `compute.py` for the one folder it was started with.

    GET  /                 the page (static/index.html); GET /static/explore.js, /static/explore.css
    GET  /api/info         the model's facts (compute.info)
    POST /api/analyze      tokens, embeddings, every attention map's overview and one map whole, the next token
    POST /api/attention    one attention map (kind, layer, head): its float32 weights
    POST /api/next         the next-token distribution under the settings
    POST /api/generate     a few tokens through generate(), step by step, with the cache's size and the timings
    POST /api/merges       the BPE merges that built one token
    GET  /health           {"status": "ok"}

A request goes through, in order: the Host header (400 unless it names this server: DNS rebinding), the body limit
(413 before anything is parsed), JSON, the body's schema (400 naming the field: unknown fields too, so nothing like
{"folder": ...} is ever read), then compute, whose UsageError is a 400 naming the field. Any other error in
compute is a 500 with a generic message (its traceback goes to the log) and the next request is served as usual.
Every error is `{"error": {"message", "param"}}` (`param`: the field at fault, as in deriv serve's errors); every
reply carries the CSP and nosniff headers. The model runs in a worker thread, one request at a time under the
Explorer's lock.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.exceptions import HTTPException

from ...errors import UsageError
from ...serving.guard import ClientGone, Guard, HostCheck, gone, read_json, require_json
from ...serving.protocol import RequestError, is_branch, json_type
from . import compute
from .compute import MAX_STEPS, MAX_TEMPERATURE, MAX_TOP, MIN_TEMPERATURE, PENALTY_LIMIT


logger = logging.getLogger("deriv_lm.explore")

STATIC = Path(__file__).parent / "static"
# The only files served: a name is looked up here, never joined to a path, so nothing outside static/ can be named.
STATIC_FILES = {
    "explore.js": "text/javascript; charset=utf-8",
    "explore.css": "text/css; charset=utf-8",
}
CSP = (
    "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'; "
    "frame-ancestors 'none'"
)
ENDPOINTS = "/, /api/info, /api/analyze, /api/attention, /api/next, /api/generate, /api/merges and /health"
INTERNAL = "internal error: the explorer failed on this request (its log has the details); other requests still work"


# ---- the bodies --------------------------------------------------------------------------------------------------

Id = Annotated[int, Field(ge=0)]


class Settings(BaseModel):
    """The next-token controls; a setting left out is the folder's (what generate() would use)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    temperature: Annotated[float, Field(ge=MIN_TEMPERATURE, le=MAX_TEMPERATURE, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    presence_penalty: Annotated[float, Field(ge=-PENALTY_LIMIT, le=PENALTY_LIMIT, allow_inf_nan=False)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-PENALTY_LIMIT, le=PENALTY_LIMIT, allow_inf_nan=False)] | None = None


class Texts(BaseModel):
    """The text (or ids) and, for a translation model, the target (or its ids)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str | None = None
    ids: list[Id] | None = None
    target: str | None = None
    target_ids: list[Id] | None = None

    @model_validator(mode="after")
    def _one_of_each(self):
        if (self.text is None) == (self.ids is None):
            raise RequestError("send exactly one of text and ids", param="text" if self.text is None else "ids")
        if self.target is not None and self.target_ids is not None:
            raise RequestError("send at most one of target and target_ids", param="target_ids")
        return self

    def inputs(self) -> dict:
        return {k: getattr(self, k) for k in ("text", "ids", "target", "target_ids") if getattr(self, k) is not None}


class Inputs(Texts):
    """The texts and the settings."""

    settings: Settings = Field(default_factory=Settings)

    def sampling(self) -> dict:
        return self.settings.model_dump(exclude_none=True)


class View(BaseModel):
    """Which attention map analyze sends whole; one left out is the first kind's, layer 0, head 0. The kind and the
    ranges are the folder's, so compute checks them."""

    model_config = ConfigDict(extra="forbid", strict=True)

    kind: str | None = None
    layer: Annotated[int, Field(ge=0)] | None = None
    head: Annotated[int, Field(ge=0)] | None = None


class NextBody(Inputs):
    top: Annotated[int, Field(ge=1, le=MAX_TOP)] = 10


class AnalyzeBody(NextBody):
    view: View = Field(default_factory=View)


class AttentionBody(Texts):
    kind: str
    layer: Annotated[int, Field(ge=0)]
    head: Annotated[int, Field(ge=0)]


class GenerateBody(Inputs):
    mode: Literal["greedy", "sample"] = "greedy"
    steps: Annotated[int, Field(ge=1, le=MAX_STEPS)] = 3
    seed: int = 0  # its range is compute's (what torch.manual_seed takes, for every device)


class MergesBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    id: Id


def parse(schema: type[BaseModel], body: Any) -> Any:
    """The body, validated against `schema`; RequestError (400) naming the first bad field otherwise."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, not {json_type(body)}")
    try:
        return schema.model_validate(body)
    except ValidationError as error:
        raise _first_error(error, schema) from None


def _first_error(error: ValidationError, schema: type[BaseModel]) -> RequestError:
    first = error.errors(include_url=False)[0]
    field = ".".join(str(p) for p in first["loc"] if not is_branch(p)) or None
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, RequestError):  # raised by a validator, naming its own field
        field = cause.param or field
        message = cause.message
    elif first["type"] == "extra_forbidden":
        inner = {"settings": Settings, "view": View}.get((field or "").partition(".")[0], schema)
        allowed = ", ".join(inner.model_fields)
        message = f"unknown field (this request takes {allowed}; the explorer shows only the folder it started with)"
    elif first["type"] == "missing":
        message = "this field is required"
    elif first["type"].endswith("_type") or first["type"] in ("literal_error", "finite_number"):
        message = f"{first['msg']}, not {json_type(first['input'])}"
    else:
        message = f"{first['msg']}, got {first['input']!r}"[:300]
    return RequestError(f"{field}: {message}" if field else message, param=field)


# ---- the app -----------------------------------------------------------------------------------------------------


def error_body(message: str, param: str | None = None) -> dict:
    """The explorer's error: the message, and in `param` the field at fault, as deriv serve's errors name it."""
    return {"error": {"message": message, "param": param}}


def build_app(ex, host: str, port: int, max_body_bytes: int):
    """The explorer's ASGI app for the loaded Explorer `ex`, answering requests addressed to host:port only, with
    request bodies of at most `max_body_bytes` (`deriv explore --max-body-bytes`)."""
    facts = compute.info(ex)
    app = FastAPI(title="deriv explore", docs_url=None, redoc_url=None, openapi_url=None)
    app.router.redirect_slashes = False  # `/api/next/` is 404, not a redirect to somewhere else

    @app.exception_handler(RequestError)
    async def _refused(request: Request, error: RequestError):
        return JSONResponse(error_body(error.message, error.param), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, error: HTTPException):
        if error.status_code == 404:
            message = f"{request.url.path}: no such page or endpoint (the explorer has {ENDPOINTS})"
        elif error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(error.detail)
        return JSONResponse(error_body(message), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def _bug(request: Request, error: Exception):
        logger.exception("deriv explore: an unexpected error on %s", request.url.path)
        return JSONResponse(error_body(INTERNAL), status_code=500)

    async def model_call(function, *args, **kwargs):
        """`function(ex, ...)` in a worker thread: a UsageError is a 400 naming its field, anything else a 500."""
        try:
            return await asyncio.to_thread(function, ex, *args, **kwargs)
        except UsageError as error:
            raise RequestError(str(error), param=getattr(error, "field", None)) from None
        except Exception:
            logger.exception("deriv explore: %s failed", function.__name__)
            raise RequestError(INTERNAL, status=500) from None

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, error: ClientGone):
        gone(request)
        return Response(status_code=400)  # nobody reads it

    async def body_of(request: Request, schema: type[BaseModel]):
        require_json(request)  # the checks every Deriv server makes: serving/guard.py
        return parse(schema, await read_json(request, max_body_bytes))

    @app.get("/")
    async def page():
        return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8")

    @app.get("/static/{name}")
    async def static(name: str):
        if name not in STATIC_FILES:
            raise HTTPException(404)
        return FileResponse(STATIC / name, media_type=STATIC_FILES[name])

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/api/info")
    async def info():
        return facts

    @app.post("/api/analyze")
    async def analyze(request: Request):
        body = await body_of(request, AnalyzeBody)
        view = body.view.model_dump(exclude_none=True)
        return await model_call(compute.analyze, body.inputs(), body.sampling(), top=body.top, view=view)

    @app.post("/api/attention")
    async def attention(request: Request):
        body = await body_of(request, AttentionBody)
        return await model_call(compute.attention, body.inputs(), body.kind, body.layer, body.head)

    @app.post("/api/next")
    async def next_token(request: Request):
        body = await body_of(request, NextBody)
        return await model_call(compute.next_token, body.inputs(), body.sampling(), top=body.top)

    @app.post("/api/generate")
    async def generate(request: Request):
        body = await body_of(request, GenerateBody)
        return await model_call(
            compute.generate_steps, body.inputs(), body.sampling(), mode=body.mode, steps=body.steps, seed=body.seed
        )

    @app.post("/api/merges")
    async def merges(request: Request):
        body = await body_of(request, MergesBody)
        return await model_call(compute.merges, body.id)

    return Guard(app, HostCheck(host, port), lambda message, code: error_body(message), security_headers)


def security_headers(path: str) -> list[tuple[bytes, bytes]]:
    """What every reply carries, refusals included (`serving.guard.Guard` adds them): the page's CSP, nosniff, and
    no-store on the API, whose answers are the model's of the moment."""
    extra = [(b"content-security-policy", CSP.encode()), (b"x-content-type-options", b"nosniff")]
    if path.startswith("/api/") or path == "/health":
        extra.append((b"cache-control", b"no-store"))
    return extra
