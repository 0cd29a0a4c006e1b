"""What both Deriv servers (`deriv serve`, `deriv explore`) share below their apps: the flags, the device, the
listening socket, and uvicorn run until Ctrl-C or SIGTERM.

One home, so the two commands accept the same addresses and devices, refuse the same mistakes in the same line,
and stop the same way. The command modules (`deriv_lm/serve.py`, `viz/commands.py`) import from here; nothing
here imports a command. Importing this module costs the standard library only: torch and uvicorn are imported in
the functions that need them, so `deriv serve --help` stays quick.
"""

from __future__ import annotations

import argparse
import signal

from ..arguments import MAX_HEADER_BYTES, integer
from ..errors import UsageError


MAX_BODY_BYTES = 1 << 20  # 1 MiB: a message far longer than any context this package trains, far below the RAM
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SERVE_MODULES = ("fastapi", "uvicorn", "pydantic")


def add_server_arguments(
    parser: argparse.ArgumentParser, *, port: int, max_body_bytes: int, body_limit: int | None = None
) -> None:
    """--host, --port, --device, --max-body-bytes and --log-level, as both servers take them: `port` and
    `max_body_bytes` are the command's defaults, `body_limit` the largest --max-body-bytes it accepts (none: any)."""
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: loopback only; 0.0.0.0 for all)"
    )
    parser.add_argument(
        "--port",
        type=integer(minimum=1, maximum=65535),
        default=port,
        help=f"port to listen on (default: {port})",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, mps, ... (default: auto)")
    parser.add_argument(
        "--max-body-bytes",
        type=integer(minimum=1024, maximum=body_limit),
        default=max_body_bytes,
        help=f"the largest request body; a larger one gets 413 before it is read (default: {max_body_bytes})",
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=LOG_LEVELS,
        help="the server's log level (info shows each request)",
    )


def require_serve_extra(command: str) -> None:
    """The serve extra, importable, or one line with its pip line (openai, in the extra for the tests' client, is
    not needed to serve)."""
    from ..errors import require_extra

    require_extra("serve", command, SERVE_MODULES)


def resolve_device(name: str) -> str:
    """`auto` as the accelerator torch has (else the CPU); any other name checked against this torch build."""
    import torch

    if name == "auto":
        return torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as error:
        raise UsageError(f"--device {name!r} is not a device torch knows ({error}); try cpu or cuda") from None
    if device.type == "cpu":
        return name
    backend = getattr(torch, device.type, None)
    available = backend is not None and hasattr(backend, "is_available") and backend.is_available()
    if not available:
        raise UsageError(
            f"--device {name}: this torch ({torch.__version__}) has no usable {device.type} device; use --device "
            "cpu, or install a torch build for your accelerator"
        )
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if device.index is not None and device.index >= count:
        raise UsageError(f"--device {name}: there are {count} {device.type} device(s), numbered from 0")
    return name


def listen(host: str, port: int):
    """A listening socket on host:port; one line naming the address if it cannot be resolved or bound."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as error:
        raise UsageError(f"--host {host!r} cannot be resolved ({error}); try 127.0.0.1 or 0.0.0.0") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as error:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    sock.setblocking(False)
    return sock


def url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_server(app, sock, log_level: str = "warning") -> None:
    """uvicorn serving the ASGI `app` on `sock` until SIGINT or SIGTERM (both a graceful stop: requests in flight
    get 5 s to finish); Ctrl-C then raises KeyboardInterrupt, SIGTERM returns. `deriv serve` and `deriv explore`
    both end this way."""
    import uvicorn

    config = server_config(app, log_level)
    # subtle: after its graceful stop uvicorn raises the signal it caught again, for the handler it found; these
    # handlers take it, so SIGTERM (docker stop, systemd) ends in exit status 0 and Ctrl-C as every command's does
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda sig, frame: received.append(sig)) for sig in STOP_SIGNALS}
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if signal.SIGINT in received:
        raise KeyboardInterrupt


def server_config(app, log_level: str = "warning", **options):
    """uvicorn's settings for both servers: a graceful stop of 5 s; h11's parser, which bounds the request line and
    headers (`MAX_HEADER_BYTES`: a larger header block is refused 431 before any route sees it), in the connection
    of `connection.py`, which answers what breaks HTTP itself in one log line; and the servers' own log records at
    --log-level, beside uvicorn's (`log_config`)."""
    import uvicorn

    from .connection import GuardedH11Protocol

    options.setdefault("log_config", log_config(log_level))
    return uvicorn.Config(
        app,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        access_log=log_level in ("info", "debug"),
        http=GuardedH11Protocol,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        **options,
    )


def log_config(log_level: str) -> dict:
    """uvicorn's logging, with the servers' own loggers (`deriv_lm.serve`, `deriv_lm.explore`) on its handler at
    `log_level`. subtle: without it their records had no handler, and Python's last resort shows warnings and errors
    only: the INFO line of a client that hangs up mid-body (docs/serving.md) never reached the log."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["deriv_lm"] = {"handlers": ["default"], "level": log_level.upper(), "propagate": False}
    return config
