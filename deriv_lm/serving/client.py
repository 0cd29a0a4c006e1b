"""The client of both Deriv servers: `deriv serve` or `deriv explore` in a child process on a free loopback port,
and one raw request to either, over the standard library's HTTP client as `curl` would send it.

The tests, the serving bench (`bench/serving.py`) and the explorer's timing (`viz/explorer/measure.py`) start
servers through it, so each starts them as a user would: the `deriv` command line, not the app in-process.
"""

from __future__ import annotations

import os
import signal
import time


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
