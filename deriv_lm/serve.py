"""`deriv serve FOLDER`: a Deriv language model behind transformers' OpenAI-compatible server.

    pip install 'deriv-lm[serve]'
    deriv serve runs/deriv-tiny                          # http://127.0.0.1:8000
    deriv serve runs/deriv-tiny --continuous-batching    # many requests decoded in one packed batch

The server is `transformers serve`'s own (`transformers.cli.serve.Serve`: FastAPI and uvicorn):
`/v1/chat/completions` with the folder's chat template, `/v1/completions`, `/v1/models`, `/health`, streaming
(server-sent events) and continuous batching over a paged KV cache. This file adds only what a custom model
needs to be served by it:

- transformers' server finds the model's class by name in the `transformers` namespace
  (`getattr(transformers, config.architectures[0])`), where a model outside the library is not, so
  `transformers serve FOLDER --trust-remote-code` loads the folder and then fails on the first request
  ("module transformers has no attribute DerivForCausalLM"). `register_with_server` puts Deriv's class where
  the server looks; the folder then loads through the installed classes, and its copied `.py` files never
  run (no `--trust-remote-code`).
- the folder is checked before the server starts (a language-model folder of Deriv's, loadable), so a wrong
  path is one line, not a traceback from a background thread;
- it listens on 127.0.0.1 unless told otherwise: nothing is exposed beyond this machine by default.

The encoder-decoder is not served: transformers' serving endpoints and its continuous batching are written for
decoder-only models (see `DerivForConditionalGeneration.init_continuous_batching`).
"""

from __future__ import annotations

import argparse
import os
import signal
import time

from .arguments import integer


# transformers sizes the paged cache of continuous batching from the memory left on the device: on a GPU that is
# what a server wants, on the CPU it is most of the machine's RAM (14 GB for a model of 0.4 MB, measured on a
# 23 GB machine). On the CPU, the cache is sized for this many sequences at full context instead.
CPU_SEQUENCES = 32
CPU_BATCH_TOKENS = 2048
PAGE_SIZE = 256  # ContinuousBatchingConfig.page_size's default: positions per block

SERVE_EXTRA = "deriv serve needs FastAPI, uvicorn, pydantic and openai: pip install 'deriv-lm[serve]'"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`deriv serve FOLDER [--host --port --continuous-batching --compile --device --dtype]`."""
    parser.description = (
        "Serve a Deriv language-model folder with transformers' OpenAI-compatible server (/v1/chat/completions, "
        "/v1/completions, streaming, continuous batching). Needs the serve extra: pip install 'deriv-lm[serve]'."
    )
    parser.add_argument("folder", help="an exported Deriv language-model folder")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: loopback only; 0.0.0.0 for all)"
    )
    parser.add_argument("--port", type=integer(minimum=1, maximum=65535), default=8000)
    parser.add_argument(
        "--continuous-batching",
        action="store_true",
        help="decode concurrent requests together in one packed batch over a paged KV cache",
    )
    parser.add_argument(
        "--cb-num-blocks",
        type=integer(minimum=1),
        default=None,
        help=f"paged KV cache size in blocks of {PAGE_SIZE} positions (default on the CPU: {CPU_SEQUENCES} full "
        "contexts; on a GPU, transformers sizes it from free memory)",
    )
    parser.add_argument(
        "--cb-max-batch-tokens",
        type=integer(minimum=1),
        default=None,
        help=f"most tokens in one packed step (default on the CPU: {CPU_BATCH_TOKENS})",
    )
    parser.add_argument("--compile", action="store_true", help="static cache and torch.compile for the decode step")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ... (default: auto)")
    parser.add_argument("--dtype", default="auto", help="auto (the weights' own), float32, bfloat16, float16")
    parser.add_argument("--log-level", default="warning", help="transformers' log level (info shows each request)")
    parser.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise SystemExit(SERVE_EXTRA)
    options = {name: getattr(ns, name) for name in ("continuous_batching", "compile", "device", "dtype", "log_level")}
    options.update(cb_num_blocks=ns.cb_num_blocks, cb_max_batch_tokens=ns.cb_max_batch_tokens)
    server = start(ns.folder, host=ns.host, port=ns.port, **options)
    print(f"deriv serve: {ns.folder} on http://{ns.host}:{ns.port}/v1 (Ctrl-C stops it)", flush=True)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill`, docker stop, systemd: the same clean stop as Ctrl-C
    wait(server)
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def wait(server) -> None:
    """Block until the server stops or Ctrl-C, then stop everything it started.

    subtle: the server runs in its thread and this one stops it with `kill_server`, which also stops the
    continuous-batching manager and unloads the model (transformers' foreground mode stops uvicorn alone), and
    handles SIGTERM as Ctrl-C. It polls rather than joins: a `join()` cut short by Ctrl-C leaves the thread
    reported dead in Python 3.11, `kill_server` then skips the shutdown, and the process never exits.
    """
    try:
        while server._thread.is_alive():
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.kill_server()


def check_servable(folder: str | os.PathLike) -> str:
    """The folder as the server will name it, once it is known to hold a Deriv language model; otherwise
    FileNotFoundError or ValueError naming the folder and the problem."""
    from transformers import AutoConfig

    from .modeling_deriv import DerivConfig

    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{folder}: no such model folder")
    try:
        config = AutoConfig.from_pretrained(folder)  # Deriv's types are registered: no remote code runs
    except Exception as error:
        raise ValueError(f"{folder}: not a model folder ({' '.join(str(error).split())})") from error
    if config.model_type != DerivConfig.model_type:
        kind = "a translation model" if config.is_encoder_decoder else f"a {config.model_type!r} model"
        raise ValueError(
            f"{folder} holds {kind}; deriv serve serves Deriv language models (transformers' server and its "
            "continuous batching are decoder-only)"
        )
    return folder


def register_with_server() -> None:
    """Make transformers' server find Deriv's language model by the name in `config.architectures`.

    subtle: the server reads the class off the module object its model manager imported as `transformers`
    (importing some transformers classes replaces `sys.modules["transformers"]`, so that object is named here,
    not whatever `import transformers` gives now).
    """
    from transformers.cli.serving import model_manager

    from .modeling_deriv import DerivForCausalLM

    setattr(model_manager.transformers, DerivForCausalLM.__name__, DerivForCausalLM)


def start(folder: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 8000, **options):
    """Serve `folder` with transformers' `Serve`, in a background thread (`wait(server)` blocks on it,
    `server.kill_server()` stops it). `options` are `Serve`'s (continuous_batching, compile, device, dtype,
    log_level, cb_num_blocks, ...); on the CPU the paged cache is sized by `cpu_batching_options`. The model is
    loaded, and the folder checked, before the server listens."""
    from transformers.cli.serve import Serve

    folder = check_servable(folder)
    register_with_server()
    if options.get("continuous_batching"):
        options = {**cpu_batching_options(folder, options.get("device", "auto")), **_given(options)}
    return Serve(force_model=folder, host=host, port=port, non_blocking=True, **options)


def _given(options: dict) -> dict:
    return {name: value for name, value in options.items() if value is not None}


def cpu_batching_options(folder: str, device: str) -> dict:
    """`Serve`'s paged-cache sizes for `CPU_SEQUENCES` sequences at the model's full context, when the model will
    run on the CPU; nothing (transformers' sizing from free memory) on an accelerator."""
    import torch
    from transformers import AutoConfig

    on_cpu = device == "cpu" or (device == "auto" and not torch.accelerator.is_available())
    if not on_cpu:
        return {}
    context = AutoConfig.from_pretrained(folder).max_position_embeddings
    return {"cb_num_blocks": -(-CPU_SEQUENCES * context // PAGE_SIZE), "cb_max_batch_tokens": CPU_BATCH_TOKENS}


class ServerProcess:
    """`deriv serve FOLDER` in a child process on a free loopback port, for tests and benchmarks: started (and
    waited for, until `/health` answers) on construction, spoken to with `post` and `stream` (the OpenAI protocol
    over the standard library's HTTP client, as `curl` would), stopped with `stop` (SIGTERM, as Ctrl-C)."""

    def __init__(self, folder: str | os.PathLike, *flags: str, log: str | os.PathLike, timeout: float = 120):
        import socket
        import subprocess
        import sys

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.folder, self.log = os.fspath(folder), log
        command = [sys.executable, "-m", "deriv_lm.cli", "serve", self.folder, "--port", str(self.port), *flags]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        with open(log, "wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        self._wait_until_healthy(timeout)

    def log_tail(self, characters: int = 3000) -> str:
        with open(self.log, encoding="utf-8", errors="replace") as f:
            return f.read()[-characters:]

    def _wait_until_healthy(self, timeout: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"deriv serve exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"deriv serve did not answer /health in {timeout} s:\n{self.log_tail()}")

    def _open(self, path: str, body: dict):
        import json
        import urllib.request

        data = json.dumps({"model": self.folder, **body}).encode()
        request = urllib.request.Request(self.url + path, data, {"Content-Type": "application/json"})
        return urllib.request.urlopen(request, timeout=300)

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
