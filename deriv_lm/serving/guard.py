"""What a request to either Deriv server (`deriv serve`, `deriv explore`) passes before any route sees it.

- **The Host header names this server.** DNS rebinding is a page on evil.example whose name is then pointed at
  127.0.0.1: its scripts reach a loopback server as same-origin, but their Host header still says evil.example.
  A name is accepted only if it cannot be rebound that way: `localhost`, the --host given, an IP address literal,
  or a name the owner allowed (`deriv serve --allow-host`, for a proxy in front), with this server's port.
- **The body is JSON, said so.** A page on another site may POST text/plain or a form to 127.0.0.1 without asking
  (a "simple" request: no CORS preflight); it cannot read the reply, but it could keep the model busy. JSON it
  cannot send without the preflight these servers never grant: anything else is 415.
- **The body arrives in time, and within its size.** A client that declares a body and sends it slowly holds a
  connection open for nothing: past `BODY_SECONDS` it is refused (408). A client that hangs up mid-body is one log
  line, not a traceback. The header block is bounded (`MAX_HEADER_BYTES`): 431 here for one that arrived whole, from
  the connection (`connection.py`) for one that outran uvicorn's h11 parser.
- **Text is text.** Bytes of the body that are not UTF-8 are refused naming the field whose text holds them.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from collections.abc import Callable
from typing import Any

from ..arguments import BODY_SECONDS, MAX_HEADER_BYTES
from .protocol import RequestError, first_invalid_text


logger = logging.getLogger("deriv_lm.serve")

__all__ = ["BODY_SECONDS", "MAX_HEADER_BYTES", "ClientGone", "Guard", "HostCheck", "read_json", "require_json"]


class HostCheck:
    """Which Host headers name a server bound to `host`:`port` (see the module docstring)."""

    def __init__(self, host: str, port: int, allowed: tuple[str, ...] = ()):
        self.port = port
        self.names = {"localhost", host.lower().strip("[]"), *(name.lower().strip("[]") for name in allowed)}
        shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else f"[{host}]" if ":" in host else host
        self.home = f"http://{shown}:{port}/"

    def allowed(self, header: str) -> bool:
        host = header.strip().lower()
        if host.endswith("]") or ":" not in host:  # `[::1]` or `localhost`: no port, so port 80
            name, port = host, "80"
        elif host.startswith("["):  # `[::1]:8008`
            name, _, port = host.rpartition(":")
        elif host.count(":") == 1:
            name, _, port = host.partition(":")
        else:
            return False
        name = name.strip("[]")
        if port != str(self.port) or not name:
            return False
        if name in self.names:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True

    def refusal(self, header: str) -> str:
        return f"Host {header[:100] or '(none)'!r} is not this server's address; open {self.home}"


class Guard:
    """ASGI middleware around a whole app (outside even its 500 handler), the one both servers wrap theirs in: a
    request whose headers are over MAX_HEADER_BYTES is refused 431, one whose Host header does not name this server
    400 (`HostCheck`: DNS rebinding), before any route or body is read.

    `refusal(message, code)` is the app's error body (the OpenAI shape for `deriv serve`, the explorer's own);
    `code` is `headers_too_large` or `invalid_host`. `headers(path)`, if given, are headers every reply to `path`
    carries, refusals included (the explorer's CSP); a header of that name the app set is replaced."""

    def __init__(
        self,
        app,
        check: HostCheck,
        refusal: Callable[[str, str], dict],
        headers: Callable[[str], list[tuple[bytes, bytes]]] | None = None,
    ):
        self.app, self.check, self.refusal, self.headers = app, check, refusal, headers

    async def __call__(self, scope, receive, send):
        from starlette.responses import JSONResponse

        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.headers is not None:
            send = with_headers(send, self.headers(scope["path"]))
        if header_bytes(scope) > MAX_HEADER_BYTES:
            body = self.refusal(header_refusal(header_bytes(scope)), "headers_too_large")
            return await JSONResponse(body, status_code=431)(scope, receive, send)
        host = host_of(scope)
        if not self.check.allowed(host):
            body = self.refusal(self.check.refusal(host), "invalid_host")
            return await JSONResponse(body, status_code=400)(scope, receive, send)
        return await self.app(scope, receive, send)


def with_headers(send, extra: list[tuple[bytes, bytes]]):
    """`send`, with `extra` in the reply's headers (replacing any of the same names)."""
    names = {name for name, _ in extra}

    async def send_with(message):
        if message["type"] == "http.response.start":
            kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
            message = {**message, "headers": kept + extra}
        await send(message)

    return send_with


def header_bytes(scope) -> int:
    """The size of a request's headers, names and values. h11 stops reading a header block over MAX_HEADER_BYTES
    that arrives in pieces (431 from `connection.py`); one that arrives whole is measured here, and refused 431
    before any route."""
    return sum(len(name) + len(value) for name, value in scope.get("headers") or [])


def header_refusal(size: int | None = None) -> str:
    """The message of a 431: with the headers' size when they arrived whole (h11 stops reading a larger block that
    arrives in pieces, `serving/connection.py`: its size is not known)."""
    if size is None:
        return f"the request's headers are over this server's limit of {MAX_HEADER_BYTES} bytes"
    return f"the request's headers are {size} bytes, over this server's limit of {MAX_HEADER_BYTES}"


def host_of(scope) -> str:
    return dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")


def require_json(request) -> None:
    """415 unless the body is declared `application/json` (see the module docstring)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise RequestError(
            f"the body is sent as {kind or 'no Content-Type'}; send it as Content-Type: application/json", status=415
        )


class ClientGone(Exception):
    """The client hung up before its request body had arrived: nobody is left to answer."""


async def read_json(request, limit: int, seconds: float = BODY_SECONDS) -> Any:
    """The body as JSON, read only up to `limit` bytes and for at most `seconds`: a larger one is refused (413)
    before it is parsed, a slower one 408; a client that hangs up raises ClientGone."""
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length")
    too_large = RequestError(
        f"the request body is larger than this server's limit of {limit} bytes (--max-body-bytes)",
        status=413,
        code="request_too_large",
    )
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        body = await asyncio.wait_for(read(), seconds)
    except asyncio.TimeoutError:
        raise RequestError(
            f"the request body did not arrive within {seconds:g} s; send it whole", status=408, code="timeout"
        ) from None
    except ClientDisconnect:
        raise ClientGone from None
    if not body.strip():
        raise RequestError("the request has no body: send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise not_utf8(body, error) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise RequestError(f"the request body is not valid JSON: {error.msg}") from None
    except RecursionError:  # a body nested deeper than Python recurses
        raise RequestError("the request body is not valid JSON: it is nested too deeply") from None
    except ValueError:  # Python's limit on the digits of an integer (4300 by default)
        raise RequestError("the request body holds a number out of range: more digits than any field takes") from None


def not_utf8(body: bytes, error: UnicodeDecodeError) -> RequestError:
    """The 400 for a body that is not UTF-8, naming the field whose text holds the bad bytes when the body is JSON
    around them (`messages.1.content: not valid text: the byte 0xff, which is not UTF-8 at character 2`), else
    the byte's offset in the body."""
    try:
        found = first_invalid_text(json.loads(body.decode("utf-8", errors="surrogateescape")))
    except (ValueError, RecursionError):  # not JSON either: the byte is all there is to say
        found = None
    if found is None:
        return RequestError(f"the request body is not valid UTF-8 (byte {error.start})")
    param, why = found
    return RequestError(f"{param or 'the request body'}: not valid text: {why}", param=param)


def gone(request) -> None:
    """The one line a client that hung up mid-request leaves in the log."""
    logger.info("%s %s: the client disconnected before its request arrived", request.method, request.url.path)
