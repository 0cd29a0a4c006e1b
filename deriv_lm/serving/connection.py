"""uvicorn's HTTP/1.1 connection (h11), changed where its answer to a broken request was wrong for these servers.

Both Deriv servers (`deriv serve`, `deriv explore`) run on it (`server.server_config`). Two things go wrong in
uvicorn's own protocol when a request breaks HTTP itself, before or while the app answers it:

- **A header block larger than h11 buffers** (`MAX_HEADER_BYTES`, arriving in pieces: a header of 1 MB) was a 400
  and a socket closed with the rest of the client's header unread, which the kernel turns into a reset: the client
  saw "connection reset by peer", not an answer. Here it is 431 in the servers' error shape, the answer the app's
  guard gives a header block that arrives whole.
- **A request that breaks HTTP after its headers** (a malformed chunked body following a request the guard refused
  early: a foreign Host, a body not declared JSON, headers too large) got uvicorn's 400, and then the app's own
  refusal of the same request failed inside h11: "Exception in ASGI application" and a traceback in the log. Here
  the app is told the client is gone (its answer is dropped, as for a client that hung up) and the log holds
  uvicorn's one line, "Invalid HTTP request received."

subtle: after either answer the connection closes gracefully ("lingering close", as Apache and nginx do): the
write side is shut, and whatever the client is still sending is read and dropped until it hangs up or
`LINGER_SECONDS` pass. Closing with unread bytes would reset the connection and could destroy the answer before the
client reads it.
"""

from __future__ import annotations

import json
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .guard import MAX_HEADER_BYTES, header_refusal


LINGER_SECONDS = 5.0
INVALID_HTTP = "the request is not HTTP/1.1 this server can read (its request line, a header or its chunked body)"


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the two answers of the module docstring."""

    lingering = False

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # what a refused client is still sending: read, and dropped
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        """uvicorn calls this when h11 cannot parse what the client sent, having logged its one line (`msg`)."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's answer to this request, if any, is dropped
            self.cycle.message_event.set()  # and a body it waits for reads as a hang-up
        if self.conn.our_state is h11.IDLE and self._headers_too_large():
            self._answer(431, header_refusal(), "headers_too_large")
        elif self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self._answer(400, INVALID_HTTP, "invalid_http")
        self._linger()

    def _headers_too_large(self) -> bool:
        return len(self.conn.trailing_data[0]) > (self.config.h11_max_incomplete_event_size or MAX_HEADER_BYTES)

    def _answer(self, status: int, message: str, code: str | None) -> None:
        body = json.dumps(
            {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        reason = HTTPStatus(status).phrase.encode()
        for event in (
            h11.Response(status_code=status, headers=headers, reason=reason),
            h11.Data(data=body),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))

    def _linger(self) -> None:
        """Shut the write side and drop what the client still sends, until it hangs up or LINGER_SECONDS pass."""
        self.lingering = True
        self._unset_keepalive_if_required()
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_SECONDS, self.transport.close)
        else:
            self.transport.close()
