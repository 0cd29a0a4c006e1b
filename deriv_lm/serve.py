"""`deriv serve FOLDER`: a Deriv language model behind an OpenAI-compatible HTTP server.

    pip install 'deriv-lm[serve]'
    deriv serve runs/deriv-tiny                          # http://127.0.0.1:8000/v1
    deriv serve runs/deriv-tiny --continuous-batching    # many requests decoded in one packed batch

The endpoints, the request checks and the limits are in `serving/app.py` and `serving/protocol.py`; decoding is
transformers' own (`generate()`, or its continuous batching over a paged KV cache: `serving/engines.py`). This
file is the command: it checks everything it can before the server listens (the extra, the device, the address,
the folder), so a mistake is one line and exit status 2, then serves until Ctrl-C or SIGTERM.

The contract (docs/serving.md): one model, the folder the server was started with, loaded from safetensors
with Deriv's installed classes (no remote code, no pickle, a LoRA adapter merged); nothing loads or unloads it
over HTTP; loopback only unless `--host` says otherwise.

subtle: this server is Deriv's, not `transformers serve`. That server loads any model a request names
(`POST /load_model`), lets any client unload it (`/reset`), and one request past the context kills its batching
worker for good; it is also written for the library's own classes. What it does well, the decoding, is what
this server keeps.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

from .arguments import BODY_SECONDS, MAX_HEADER_BYTES, integer, invalid_text, model_folder, number
from .errors import MissingFile, UsageError


# transformers sizes the paged cache of continuous batching from the memory left on the device: on a GPU that is
# what a server wants, on the CPU it is most of the machine's RAM (14 GB for a model of 0.4 MB, measured on a
# 23 GB machine). On the CPU, the cache is sized for this many sequences at full context instead.
CPU_SEQUENCES = 32
CPU_BATCH_TOKENS = 2048
PAGE_SIZE = 256  # ContinuousBatchingConfig.page_size's default: positions per block
MAX_BODY_BYTES = 1 << 20  # 1 MiB: a message far longer than any context this package trains, far below the RAM

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SERVE_MODULES = ("fastapi", "uvicorn", "pydantic")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`deriv serve FOLDER [--host --port --continuous-batching --device --dtype ...]`."""
    parser.description = (
        "Serve a Deriv language-model folder over HTTP with the OpenAI API (/v1/chat/completions, /v1/completions, "
        "streaming, continuous batching). Every request is checked before it is decoded; see docs/serving.md. "
        "Needs the serve extra: pip install 'deriv-lm[serve]'."
    )
    parser.add_argument("folder", type=model_folder, help="an exported Deriv language-model folder")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: loopback only; 0.0.0.0 for all)"
    )
    parser.add_argument("--port", type=integer(minimum=1, maximum=65535), default=8000)
    parser.add_argument(
        "--served-model-name",
        type=served_name,
        default=None,
        help="the model's id in requests and replies (default: the folder's name, never its full path)",
    )
    parser.add_argument(
        "--continuous-batching",
        action="store_true",
        help="decode concurrent requests together in one packed batch over a paged KV cache (every request "
        "then decodes with the folder's sampling settings)",
    )
    parser.add_argument(
        "--cb-num-blocks",
        type=integer(minimum=1, maximum=1 << 20),
        default=None,
        help=f"paged KV cache size in blocks of {PAGE_SIZE} positions (default on the CPU: {CPU_SEQUENCES} full "
        "contexts; on a GPU, transformers sizes it from free memory)",
    )
    parser.add_argument(
        "--cb-max-batch-tokens",
        type=integer(minimum=1, maximum=1 << 20),
        default=None,
        help=f"most tokens in one packed step (default on the CPU: {CPU_BATCH_TOKENS})",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=integer(minimum=1024),
        default=MAX_BODY_BYTES,
        help=f"the largest request body; a larger one gets 413 before it is read (default: {MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--read-timeout",
        type=number(above=0, maximum=3600),
        default=BODY_SECONDS,
        help=f"seconds a request body may take to arrive; a slower one gets 408 (default: {BODY_SECONDS:g})",
    )
    parser.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a name the Host header may give besides localhost, --host and IP addresses (a proxy's; repeat it for "
        "more). Other names are refused: a page elsewhere cannot reach this server through DNS rebinding",
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=integer(minimum=1, maximum=100_000),
        default=64,
        help="requests decoded or waiting at once; more get 429 (default: 64)",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, mps, ... (default: auto)")
    parser.add_argument(
        "--decode-loop",
        choices=("compiled", "eager"),
        default=None,
        help="decode each request in Deriv's loop, the whole step compiled into one graph (compiled at start; no "
        "frequency_penalty; not with --continuous-batching)",
    )
    parser.add_argument(
        "--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"), help="auto: the weights' own"
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=("critical", "error", "warning", "info", "debug"),
        help="the server's log level (info shows each request)",
    )
    parser.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    check_flags(ns)
    check_extra()
    device = resolve_device(ns.device)
    sock = listen(ns.host, ns.port)  # the address first: a port in use is found in a blink, not after loading
    ns.port = sock.getsockname()[1]  # the one the OS chose for --port 0
    try:
        served = load(ns, device)
    except BaseException:
        sock.close()
        raise
    print(f"deriv serve: {served.name} ({ns.folder}) on {url(ns.host, ns.port)}/v1 (Ctrl-C stops it)", flush=True)
    try:
        serve(served, sock, ns.log_level)
    finally:
        served.engine.stop()
    return 0


def served_name(text: str) -> str:
    """An argparse type: the model's id in requests and replies. Every reply carries it as JSON text, so bytes that
    are not UTF-8 (`$'\\xff'` in a shell, a surrogate in Python's argv) would make every reply, /health too, fail
    to encode: refused as the line is parsed, as are an empty id and a path."""
    why = invalid_text(text)
    if why:
        raise argparse.ArgumentTypeError(f"not valid text: {why}; give the id clients will send as `model`")
    if not text.strip() or text.startswith("/"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give the id clients will send as `model` (not empty, not a path); leave it out for the "
            "folder's name"
        )
    return text


def check_flags(ns: argparse.Namespace) -> None:
    """Flags that cannot do what they say, refused before anything starts."""
    sized = [
        flag
        for flag, value in (("--cb-num-blocks", ns.cb_num_blocks), ("--cb-max-batch-tokens", ns.cb_max_batch_tokens))
        if value is not None
    ]
    if ns.decode_loop and ns.continuous_batching:
        raise UsageError(
            "--decode-loop and --continuous-batching are two ways to decode: the loop runs one request at a time, "
            "batching many; pick one"
        )
    if sized and not ns.continuous_batching:
        raise UsageError(
            f"{' and '.join(sized)} size the paged cache of --continuous-batching, which is off: add "
            "--continuous-batching, or leave them out"
        )


def check_extra() -> None:
    """The serve extra, importable, or one line with its pip line (openai, in the extra for the tests' client, is
    not needed to serve)."""
    from .errors import require_extra

    require_extra("serve", "deriv serve", SERVE_MODULES)


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


def load(ns: argparse.Namespace, device: str):
    """The folder, loaded as every command loads one (safetensors only, Deriv's classes, the adapter merged), on
    its device, behind the engine the flags ask for."""
    import torch

    from .folder.load import load_folder
    from .serving.app import Served
    from .serving.engines import BatchingEngine, GenerateEngine
    from .tokenization.chat_template import check_template_source

    folder = check_servable(ns.folder)
    loaded = load_folder(folder, seq2seq=False)
    check_template_source(loaded.tokenizer.chat_template, folder)  # {% include %} and the like: refused now
    model = loaded.model
    if ns.dtype != "auto":
        model = model.to(getattr(torch, ns.dtype))
    model = model.to(device).eval()
    generation = model.generation_config
    generation.num_beams = 1  # a server streams: one beam (greedy or sampling), as the OpenAI API decodes
    if ns.continuous_batching:
        from transformers import ContinuousBatchingConfig

        sizes = cpu_batching_options(model.config.max_position_embeddings, device)
        sizes.update(
            {k: v for k, v in (("num_blocks", ns.cb_num_blocks), ("max_batch_tokens", ns.cb_max_batch_tokens)) if v}
        )
        engine = BatchingEngine(model, generation, ContinuousBatchingConfig(**sizes))
    else:
        engine = GenerateEngine(model, generation)
        if ns.decode_loop:
            try:  # on the engine's worker thread, where requests will run it (CUDA graphs are recorded per thread)
                engine.run_on_worker(warm_decode_loop, model, generation, ns.decode_loop, folder)
            except BaseException:
                engine.stop()
                raise
    name = ns.served_model_name or os.path.basename(os.path.normpath(folder))
    return Served(
        name=name,
        model=model,
        tokenizer=loaded.tokenizer,
        engine=engine,
        max_body_bytes=ns.max_body_bytes,
        max_concurrent_requests=ns.max_concurrent_requests,
        aliases=(folder,),
        host=ns.host,
        port=ns.port,
        allowed_hosts=tuple(ns.allow_host),
        body_seconds=ns.read_timeout,
    )


def warm_decode_loop(model, generation, loop: str, folder: str) -> None:
    """Switch the folder's generation config to the decode loop and run it once greedily and once sampling before
    the server listens: both graphs compile now, not in the first request of each kind (every sampling setting is
    an input of the one sampling graph), and a setting of the folder's the loop cannot run is one line now, not a
    failed request later."""
    import torch

    from .modeling_deriv.decode_loop import DecodeLoopUnsupported

    generation.decode_loop = loop
    prompt = torch.tensor([[model.generation_config.bos_token_id or 0]], device=model.device)
    try:
        with torch.no_grad():
            for sample in (False, True):
                extra = {"temperature": 1.0} if sample else {}  # a folder's temperature may be 0 (greedy)
                model.generate(prompt, generation_config=generation, max_new_tokens=2, do_sample=sample, **extra)
    except DecodeLoopUnsupported as error:
        raise UsageError(f"--decode-loop cannot serve {folder} with its generation_config.json: {error}") from None


def serve(served, sock, log_level: str = "warning") -> None:
    """The OpenAI app on `sock` until SIGINT or SIGTERM."""
    from .serving.app import build_app

    run_server(build_app(served), sock, log_level)


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
    of `serving/connection.py`, which answers what breaks HTTP itself in one log line; and the servers' own log
    records at --log-level, beside uvicorn's (`log_config`)."""
    import uvicorn

    from .serving.connection import GuardedH11Protocol

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


def check_servable(folder: str | os.PathLike) -> str:
    """The folder, once it is known to hold a Deriv language model; otherwise FileNotFoundError or ValueError
    naming the folder and the problem."""
    from transformers import AutoConfig

    from .folder.load import checked_files
    from .modeling_deriv import DerivConfig

    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise MissingFile(f"{folder}: no such model folder")
    checked_files(folder)  # before transformers reads config.json: no link out, no FIFO among what it reads
    try:
        config = AutoConfig.from_pretrained(folder)  # Deriv's types are registered: no remote code runs
    except Exception as error:
        raise UsageError(f"{folder}: not a model folder ({' '.join(str(error).split())})") from error
    if config.model_type != DerivConfig.model_type:
        kind = "a translation model" if config.is_encoder_decoder else f"a {config.model_type!r} model"
        raise UsageError(
            f"{folder} holds {kind}; deriv serve serves Deriv language models (its endpoints and continuous "
            "batching are decoder-only)"
        )
    return folder


def cpu_batching_options(context: int, device: str) -> dict:
    """The paged-cache sizes for `CPU_SEQUENCES` sequences at the model's full context, on the CPU; nothing
    (transformers' sizing from free memory) on an accelerator."""
    if device != "cpu":
        return {}
    return {"num_blocks": -(-CPU_SEQUENCES * context // PAGE_SIZE), "max_batch_tokens": CPU_BATCH_TOKENS}


class ServerProcess:
    """`deriv serve FOLDER` (or, with `command="explore"`, `deriv explore FOLDER`) in a child process on a free
    loopback port, for tests and benchmarks: started (and waited for, until `/health` answers) on construction,
    spoken to with `send`, `post` and `stream` (over the standard library's HTTP client, as `curl` would), stopped
    with `stop` (SIGTERM, as Ctrl-C)."""

    def __init__(
        self,
        folder: str | os.PathLike,
        *flags: str,
        log: str | os.PathLike,
        timeout: float = 120,
        command: str = "serve",
    ):
        import socket
        import subprocess
        import sys

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.folder, self.log, self.command = os.fspath(folder), log, command
        argv = [sys.executable, "-m", "deriv_lm.cli", command, self.folder, "--port", str(self.port), *flags]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(log, "wb") as out:
            self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        self._wait_until_healthy(timeout)

    def log_tail(self, characters: int = 3000) -> str:
        with open(self.log, encoding="utf-8", errors="replace") as f:
            return f.read()[-characters:]

    def _wait_until_healthy(self, timeout: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"deriv {self.command} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"deriv {self.command} did not answer /health in {timeout} s:\n{self.log_tail()}")

    def _open(self, path: str, body: dict):
        import json
        import urllib.request

        data = json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"})
        return urllib.request.urlopen(request, timeout=300)

    def send(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        """Any request, as raw bytes: (HTTP status, the reply's JSON or None, its headers). Errors are returned,
        not raised, for the tests that send what a careless or hostile client would."""
        status, payload, reply_headers, _ = send_request(self.port, method, path, body, headers)
        return status, payload, reply_headers

    def post(self, path: str, body: dict) -> dict:
        import json

        with self._open(path, body) as reply:
            return json.loads(reply.read())

    def stream(self, path: str, body: dict) -> list[dict]:
        """The server-sent events of a streaming request, decoded, up to `[DONE]` or the end of the reply."""
        import json

        events = []
        with self._open(path, {**body, "stream": True}) as reply:
            if reply.headers.get_content_type() != "text/event-stream":
                raise ValueError(f"expected server-sent events, got {reply.headers.get_content_type()}")
            for line in reply:
                line = line.decode().strip()
                if not line.startswith("data:"):
                    continue
                payload = line.removeprefix("data:").strip()
                if payload == "[DONE]":
                    break
                events.append(json.loads(payload))
        return events

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then the exit status (a kill, and -9, if it has not stopped within `timeout` seconds)."""
        import subprocess

        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def send_request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """One request to a server on this machine's loopback `port`, as raw bytes: (HTTP status, the reply's JSON or
    None, its headers, its raw bytes). Errors are returned, not raised."""
    import http.client
    import json

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        reply = connection.getresponse()
        raw = reply.read()
    finally:
        connection.close()
    try:
        payload = json.loads(raw) if raw else None
    except ValueError:
        payload = None
    return reply.status, payload, dict(reply.getheaders()), raw
