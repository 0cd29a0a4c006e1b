"""`deriv explore` against what careless and hostile clients send, and the command's own refusals.

One `deriv explore` (its parser, loader and app in a thread of this process, on tests/data/numbers_lm, 127.0.0.1,
a free port) answers every row of the table (docs/explore.md has the same table): the status the row names, in
the error shape `{"error": {"message", "param"}}` with the field the row names, the security headers on the reply,
and after it the server still answers /health and a good /api/analyze. A request that makes compute raise an
unexpected error is tried in this process (compute patched to fail once), where the reply must be a 500 that says
nothing of the error and the next request must be served. What only a process shows (the line that says where it
serves, Ctrl-C's exit status, a translation folder opened from the command line) is tried on `deriv explore` in a
child process. The command's refusals are one `deriv: error:` line and exit status 2, before anything is served.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
from conftest import ServerThread, cli_error

from deriv_lm.serving.client import ServerProcess, send_request


pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'deriv-lm[serve]')")
pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install 'deriv-lm[serve]')")

DATA = Path(__file__).parent / "data"
FOLDER = DATA / "numbers_lm"  # a language model: context 64, vocabulary 300
PROMPT = "5 3 1 8 :"
GOOD = {"text": PROMPT}
MAP = {**GOOD, "kind": "decoder", "layer": 1, "head": 3}  # numbers_lm: 2 layers of 4 heads, one kind
CSP = (
    "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; connect-src 'self'; "
    "frame-ancestors 'none'"
)
BODY_LIMIT = 256 * 1024  # deriv explore's default --max-body-bytes


def send(port: int, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None):
    """(status, the reply's JSON or None, its headers with lower-case names, its raw bytes)."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    status, payload, reply_headers, raw = send_request(port, method, path, body, headers)
    return status, payload, {k.lower(): v for k, v in reply_headers.items()}, raw


@pytest.fixture(scope="module")
def server():
    server = ServerThread(FOLDER, command="explore")
    yield server
    # no signal (the server is a thread of this process): uvicorn's graceful stop, 0 once its thread has ended
    assert server.stop() == 0, server.log_tail()
    assert "Traceback" not in server.log_tail(100_000)


# ---- the table -------------------------------------------------------------------------------------------------

OVER_LIMIT = b'{"text": "' + b"5 " * (BODY_LIMIT // 2 + 10) + b'"}'
ONE_MEGABYTE = json.dumps({"text": "x" * 1_000_000}).encode()
PAST_CONTEXT = " ".join(["5"] * 40)  # 79 tokens (digits and spaces) for a context of 64

# (id, method, path, body, status, field, a piece of the message)
ROWS = [
    ("not JSON", "POST", "/api/analyze", b"{text: 5", 400, None, "not valid JSON"),
    ("not an object", "POST", "/api/analyze", b"[1, 2]", 400, None, "must be a JSON object, not an array"),
    ("a string body", "POST", "/api/next", b'"text"', 400, None, "must be a JSON object"),
    ("empty body", "POST", "/api/analyze", b"", 400, None, "no body"),
    ("nested too deep", "POST", "/api/analyze", b"[" * 100_000, 400, None, "not valid JSON"),
    ("over the limit", "POST", "/api/analyze", OVER_LIMIT, 413, None, f"limit of {BODY_LIMIT} bytes"),
    ("a 1 MB string", "POST", "/api/analyze", ONE_MEGABYTE, 413, None, "larger than"),
    ("unknown field", "POST", "/api/analyze", {**GOOD, "bogus": 1}, 400, "bogus", "unknown field"),
    ("folder", "POST", "/api/analyze", {**GOOD, "folder": "/etc"}, 400, "folder", "unknown field"),
    ("model", "POST", "/api/next", {**GOOD, "model": "gpt2"}, 400, "model", "unknown field"),
    ("trust_remote_code", "POST", "/api/generate", {**GOOD, "trust_remote_code": True}, 400, "trust_remote_code", ""),
    ("unknown setting", "POST", "/api/next", {**GOOD, "settings": {"beams": 4}}, 400, "settings.beams", "unknown"),
    ("merges unknown field", "POST", "/api/merges", {"id": 5, "folder": "x"}, 400, "folder", "unknown field"),
    ("text and ids", "POST", "/api/analyze", {"text": "5", "ids": [26]}, 400, "ids", "exactly one of text and ids"),
    ("neither", "POST", "/api/analyze", {"top": 5}, 400, "text", "exactly one of text and ids"),
    ("text not a string", "POST", "/api/analyze", {"text": 5}, 400, "text", "valid string"),
    ("empty text", "POST", "/api/analyze", {"text": ""}, 400, "text", "empty"),
    ("ids not a list", "POST", "/api/analyze", {"ids": 26}, 400, "ids", "valid list"),
    ("ids not ints", "POST", "/api/analyze", {"ids": [26, "a"]}, 400, "ids.1", "valid integer"),
    ("ids a float", "POST", "/api/analyze", {"ids": [26.5]}, 400, "ids.0", "valid integer"),
    ("ids a bool", "POST", "/api/analyze", {"ids": [26, True]}, 400, "ids.1", "not a boolean"),
    ("ids out of range", "POST", "/api/analyze", {"ids": [26, 300]}, 400, "ids", "from 0 to 299"),
    ("ids huge", "POST", "/api/next", {"ids": [10**30]}, 400, "ids", "from 0 to 299"),
    ("ids negative", "POST", "/api/analyze", {"ids": [-1]}, 400, "ids.0", "greater than or equal to 0"),
    ("empty ids", "POST", "/api/analyze", {"ids": []}, 400, "ids", "empty"),
    ("text past the context", "POST", "/api/analyze", {"text": PAST_CONTEXT}, 400, "text", "at most 64 (its context)"),
    ("ids past the context", "POST", "/api/next", {"ids": [26] * 65}, 400, "ids", "at most 64 (its context)"),
    ("a target for a language model", "POST", "/api/analyze", {**GOOD, "target": "5"}, 400, "target", "not an input"),
    ("steps 0", "POST", "/api/generate", {**GOOD, "steps": 0}, 400, "steps", "greater than or equal to 1"),
    ("steps 65", "POST", "/api/generate", {**GOOD, "steps": 65}, 400, "steps", "less than or equal to 64"),
    ("steps huge", "POST", "/api/generate", {**GOOD, "steps": 10**30}, 400, "steps", "less than or equal to 64"),
    ("steps a string", "POST", "/api/generate", {**GOOD, "steps": "3"}, 400, "steps", "valid integer"),
    ("steps past the context", "POST", "/api/generate", {"ids": [26] * 60, "steps": 5}, 400, "steps", "at most 4"),
    ("seed negative", "POST", "/api/generate", {**GOOD, "mode": "sample", "seed": -1}, 400, "seed", "from 0"),
    ("seed huge", "POST", "/api/generate", {**GOOD, "mode": "sample", "seed": 2**70}, 400, "seed", "from 0"),
    ("mode beam", "POST", "/api/generate", {**GOOD, "mode": "beam"}, 400, "mode", "'greedy' or 'sample'"),
    ("temperature 0", "POST", "/api/next", {**GOOD, "settings": {"temperature": 0}}, 400, "settings.temperature", ""),
    (
        "temperature 1e-39",  # logits / T overflow to inf: the softmax would not be a number
        "POST",
        "/api/next",
        {**GOOD, "settings": {"temperature": 1e-39}},
        400,
        "settings.temperature",
        "greater than or equal to 0.01",
    ),
    ("a lone surrogate", "POST", "/api/analyze", b'{"text": "5 \\ud800"}', 400, "text", "lone surrogate"),
    ("view on next", "POST", "/api/next", {**GOOD, "view": {"layer": 0}}, 400, "view", "unknown field"),
    ("a text/plain body", "POST", "/api/generate", GOOD, 415, None, "send it as Content-Type: application/json"),
    ("a form body", "POST", "/api/analyze", GOOD, 415, None, "send it as Content-Type: application/json"),
    (
        "temperature nan",
        "POST",
        "/api/next",
        {**GOOD, "settings": {"temperature": "nan"}},
        400,
        "settings.temperature",
        "valid number",
    ),
    (
        "temperature 1e400",
        "POST",
        "/api/next",
        b'{"text": "5", "settings": {"temperature": 1e400}}',
        400,
        "settings.temperature",
        "finite",
    ),
    (
        "temperature past 100",
        "POST",
        "/api/next",
        {**GOOD, "settings": {"temperature": 101}},
        400,
        "settings.temperature",
        "less than or equal to 100",
    ),
    ("top_p 2", "POST", "/api/next", {**GOOD, "settings": {"top_p": 2}}, 400, "settings.top_p", "less than or equal"),
    ("top_p 0", "POST", "/api/next", {**GOOD, "settings": {"top_p": 0}}, 400, "settings.top_p", "greater than 0"),
    ("top_k -1", "POST", "/api/next", {**GOOD, "settings": {"top_k": -1}}, 400, "settings.top_k", "greater than"),
    ("top_k a float", "POST", "/api/next", {**GOOD, "settings": {"top_k": 2.5}}, 400, "settings.top_k", "integer"),
    (
        "presence_penalty 3",
        "POST",
        "/api/next",
        {**GOOD, "settings": {"presence_penalty": 3}},
        400,
        "settings.presence_penalty",
        "less than or equal to 2",
    ),
    (
        "frequency_penalty -3",
        "POST",
        "/api/next",
        {**GOOD, "settings": {"frequency_penalty": -3}},
        400,
        "settings.frequency_penalty",
        "greater than or equal to -2",
    ),
    ("settings not an object", "POST", "/api/analyze", {**GOOD, "settings": [1]}, 400, "settings", "valid dictionary"),
    ("top 0", "POST", "/api/analyze", {**GOOD, "top": 0}, 400, "top", "greater than or equal to 1"),
    ("top 101", "POST", "/api/next", {**GOOD, "top": 101}, 400, "top", "less than or equal to 100"),
    ("merges id out of range", "POST", "/api/merges", {"id": 300}, 400, "id", "token ids run from 0 to"),
    ("merges id negative", "POST", "/api/merges", {"id": -1}, 400, "id", "greater than or equal to 0"),
    ("merges id missing", "POST", "/api/merges", {}, 400, "id", "required"),
    ("merges id a bool", "POST", "/api/merges", {"id": False}, 400, "id", "valid integer"),
    ("attention kind not the folder's", "POST", "/api/attention", {**MAP, "kind": "cross"}, 400, "kind", "'decoder'"),
    ("attention layer out of range", "POST", "/api/attention", {**MAP, "layer": 2}, 400, "layer", "layers 0 to 1"),
    ("attention head out of range", "POST", "/api/attention", {**MAP, "head": 4}, 400, "head", "heads 0 to 3"),
    (
        "attention layer negative",
        "POST",
        "/api/attention",
        {**MAP, "layer": -1},
        400,
        "layer",
        "greater than or equal",
    ),
    ("attention layer huge", "POST", "/api/attention", {**MAP, "layer": 10**30}, 400, "layer", "layers 0 to 1"),
    ("attention head a string", "POST", "/api/attention", {**MAP, "head": "1"}, 400, "head", "valid integer"),
    ("attention head a bool", "POST", "/api/attention", {**MAP, "head": True}, 400, "head", "valid integer"),
    ("attention kind a number", "POST", "/api/attention", {**MAP, "kind": 0}, 400, "kind", "valid string"),
    ("attention kind missing", "POST", "/api/attention", {**GOOD, "layer": 0, "head": 0}, 400, "kind", "required"),
    ("attention unknown field", "POST", "/api/attention", {**MAP, "folder": "/etc"}, 400, "folder", "unknown field"),
    ("attention empty text", "POST", "/api/attention", {**MAP, "text": ""}, 400, "text", "empty"),
    (
        "attention ids out of range",
        "POST",
        "/api/attention",
        {"ids": [300], "kind": "decoder", "layer": 0, "head": 0},
        400,
        "ids",
        "from 0 to 299",
    ),
    ("view kind not the folder's", "POST", "/api/analyze", {**GOOD, "view": {"kind": "cross"}}, 400, "view.kind", ""),
    ("view layer out of range", "POST", "/api/analyze", {**GOOD, "view": {"layer": 2}}, 400, "view.layer", "0 to 1"),
    ("view head negative", "POST", "/api/analyze", {**GOOD, "view": {"head": -1}}, 400, "view.head", "greater than"),
    ("view unknown field", "POST", "/api/analyze", {**GOOD, "view": {"row": 1}}, 400, "view.row", "unknown field"),
    ("view not an object", "POST", "/api/analyze", {**GOOD, "view": [0, 0]}, 400, "view", "valid dictionary"),
    ("GET on a POST route", "GET", "/api/analyze", None, 405, None, "GET is not allowed on /api/analyze"),
    ("GET on /api/attention", "GET", "/api/attention", None, 405, None, "GET is not allowed on /api/attention"),
    ("POST on a GET route", "POST", "/api/info", GOOD, 405, None, "not allowed"),
    ("unknown path", "GET", "/api/nothing", None, 404, None, "no such page or endpoint"),
    ("a trailing slash", "POST", "/api/next/", GOOD, 404, None, "no such page or endpoint"),
    ("static ..", "GET", "/static/../app.py", None, 404, None, "no such"),
    ("static %2e%2e", "GET", "/static/%2e%2e/app.py", None, 404, None, "no such"),
    ("static %2e%2e%2f", "GET", "/static/%2e%2e%2fapp.py", None, 404, None, "no such"),
    ("static ../..", "GET", "/static/../../deriv_lm/serve.py", None, 404, None, "no such"),
    ("static a sibling", "GET", "/static/compute.py", None, 404, None, "no such"),
    ("static the page", "GET", "/static/index.html", None, 404, None, "no such"),
    ("static an absolute path", "GET", "/static//etc/passwd", None, 404, None, "no such"),
    ("Host not the server's", "GET", "/health", None, 400, None, "is not this server's address"),
    ("Host with another port", "GET", "/api/info", None, 400, None, "is not this server's address"),
]
HOSTS = {"Host not the server's": "evil.example:{port}", "Host with another port": "127.0.0.1:1"}


def check_headers(headers: dict, path: str) -> None:
    assert headers.get("content-security-policy") == CSP
    assert headers.get("x-content-type-options") == "nosniff"
    if path.startswith("/api/"):
        assert headers.get("cache-control") == "no-store"


def check_still_serving(server) -> None:
    status, payload, headers, _ = send(server.port, "GET", "/health")
    assert (status, payload) == (200, {"status": "ok"})
    status, payload, headers, _ = send(server.port, "POST", "/api/analyze", GOOD)
    assert status == 200, payload
    assert [t["piece"] for t in payload["tokens"]][:3] == ["5", " ", "3"]
    check_headers(headers, "/api/analyze")


CONTENT_TYPES = {"a text/plain body": "text/plain", "a form body": "application/x-www-form-urlencoded"}


@pytest.mark.parametrize("name, method, path, body, status, field, message", ROWS, ids=[row[0] for row in ROWS])
def test_a_hostile_request_is_refused_in_one_message_and_the_server_goes_on(
    server, name, method, path, body, status, field, message
):
    headers = {"Host": HOSTS[name].format(port=server.port)} if name in HOSTS else {}
    if name in CONTENT_TYPES:  # what a page on another site may send without a CORS preflight
        headers["Content-Type"] = CONTENT_TYPES[name]
    got, payload, reply_headers, raw = send(server.port, method, path, body, headers)
    assert got == status, payload
    assert set(payload) == {"error"} and set(payload["error"]) == {"message", "param"}, payload
    assert payload["error"]["param"] == field, payload
    assert message in payload["error"]["message"], payload
    assert b"import " not in raw  # no file of the package (nothing outside static/ is ever read)
    check_headers(reply_headers, path)
    check_still_serving(server)


def test_the_table_in_the_docs_has_a_row_for_each_test_row():
    page = (Path(__file__).parents[1] / "docs" / "explore.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip() for line in page.splitlines() if line.startswith("| ")}
    missing = [name for name, *_ in ROWS if name not in rows]
    assert not missing, f"docs/explore.md's hostile-input table lacks: {missing}"


def test_good_requests_are_answered_with_the_security_headers(server):
    for method, path, body in [
        ("GET", "/health", None),
        ("GET", "/api/info", None),
        ("POST", "/api/analyze", GOOD),
        ("POST", "/api/analyze", {**GOOD, "view": {"kind": "decoder", "layer": 1, "head": 3}}),
        ("POST", "/api/attention", MAP),
        ("POST", "/api/next", {**GOOD, "settings": {"temperature": 0.7, "top_k": 5}, "top": 3}),
        ("POST", "/api/generate", {**GOOD, "steps": 2}),
        ("POST", "/api/merges", {"id": 26}),
    ]:
        status, payload, headers, _ = send(server.port, method, path, body)
        assert status == 200, (path, payload)
        check_headers(headers, path)
    status, payload, _, _ = send(server.port, "POST", "/api/next", {**GOOD, "top": 3})
    assert len(payload["candidates"]) == 3
    status, analyzed, _, _ = send(server.port, "POST", "/api/analyze", {**GOOD, "view": {"layer": 1, "head": 3}})
    status, switched, _, _ = send(server.port, "POST", "/api/attention", MAP)
    assert analyzed["view"]["weights"] == switched["weights"] and switched["weights"]["dtype"] == "float32"
    assert (switched["kind"], switched["layer"], switched["head"]) == ("decoder", 1, 3)


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "[::1]:{port}", "LOCALHOST:{port}"])
def test_the_server_answers_its_own_names(server, host):
    status, payload, _, _ = send(server.port, "GET", "/health", headers={"Host": host.format(port=server.port)})
    assert (status, payload) == (200, {"status": "ok"})


@pytest.mark.parametrize("host", ["", "evil.example", "localhost", "localhost:{port}.evil.example", "127.0.0.1:x"])
def test_a_host_that_is_not_the_server_is_refused(server, host):
    status, payload, headers, _ = send(server.port, "GET", "/health", headers={"Host": host.format(port=server.port)})
    assert status == 400 and "is not this server's address" in payload["error"]["message"]
    check_headers(headers, "/health")


def test_the_page_and_its_two_files_are_served_and_reach_for_no_url(server):
    """The page is three files served from the package; no script, style or font comes from anywhere else.
    subtle: `http://www.w3.org/...` in a script is an XML namespace name (createElementNS), never fetched."""
    status, _, headers, page = send(server.port, "GET", "/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    check_headers(headers, "/")
    texts = {"/": page.decode()}
    for name, kind in [("explore.js", "text/javascript"), ("explore.css", "text/css")]:
        assert f"static/{name}" in texts["/"]
        status, _, headers, body = send(server.port, "GET", f"/static/{name}")
        assert status == 200 and headers["content-type"].startswith(kind), name
        check_headers(headers, f"/static/{name}")
        texts[name] = body.decode()
    for name, text in texts.items():
        urls = [u for u in re.findall(r"https?://[^\s\"'`)<>]*", text) if not u.startswith("http://www.w3.org/")]
        assert not urls, f"{name} references {urls}"
        assert "@import" not in text and "@font-face" not in text, name


@pytest.mark.slow
def test_a_translation_folder_is_explored_and_its_target_checked(tmp_path):
    """numbers_en (context 16): the cross-attention is there; a bad target is a 400 naming the target's field."""
    server = ServerProcess(DATA / "numbers_en", log=tmp_path / "translation.log", command="explore")
    try:
        status, payload, _, _ = send(server.port, "POST", "/api/analyze", {"text": "5 3 1", "target": "five"})
        assert status == 200 and list(payload["attention"]) == ["cross", "encoder", "decoder"]
        assert payload["view"]["kind"] == "cross"  # the alignment first
        source = len(payload["tokens"])
        body = {"text": "5 3 1", "target": "five", "kind": "encoder", "layer": 1, "head": 0}
        status, payload, _, _ = send(server.port, "POST", "/api/attention", body)
        assert status == 200 and payload["weights"]["shape"] == [source, source]
        status, payload, _, _ = send(server.port, "POST", "/api/attention", {**body, "kind": "self"})
        assert (status, payload["error"]["param"]) == (400, "kind") and "'cross', 'encoder'" in payload["error"][
            "message"
        ]
        for body, field, message in [
            ({"text": "5 3 1", "target_ids": [300]}, "target_ids", "from 0 to 299"),
            ({"text": "5 3 1", "target": "5", "target_ids": [26]}, "target_ids", "at most one of target"),
            ({"text": "5 3 1", "target": "five " * 10}, "target", "its context"),
        ]:
            status, payload, _, _ = send(server.port, "POST", "/api/next", body)
            assert (status, payload["error"]["param"]) == (400, field) and message in payload["error"]["message"]
        status, _, _, _ = send(server.port, "POST", "/api/generate", {"text": "5 3 1", "steps": 2})
        assert status == 200
    finally:
        assert server.stop() == 0, server.log_tail()


@pytest.mark.slow
def test_the_command_says_where_it_serves_and_ctrl_c_stops_it_with_status_130(tmp_path):
    server = ServerProcess(FOLDER, log=tmp_path / "int.log", command="explore")
    assert f"deriv explore: numbers_lm ({FOLDER}) on http://127.0.0.1:{server.port} (Ctrl-C stops it)" in (
        server.log_tail()
    )
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(timeout=60) == 130
    assert "Traceback" not in server.log_tail()


# ---- a bug in compute: a 500, and the next request served --------------------------------------------------------


@pytest.fixture
def in_process(monkeypatch):
    """A second explorer (ServerThread), with compute.analyze failing on its first call (as a bug would); yields
    its port."""
    from deriv_lm.viz.explorer import compute

    real, calls = compute.analyze, []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a secret detail of the failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(compute, "analyze", failing_once)
    server = ServerThread(FOLDER, command="explore")
    yield server.port
    assert server.stop() == 0


def test_an_unexpected_error_is_a_500_that_tells_nothing_and_the_server_goes_on(in_process, caplog):
    status, payload, headers, _ = send(in_process, "POST", "/api/analyze", GOOD)
    assert status == 500
    assert payload["error"]["param"] is None and "internal error" in payload["error"]["message"]
    assert "secret" not in json.dumps(payload)
    check_headers(headers, "/api/analyze")
    assert any(r.exc_info and "secret detail" in str(r.exc_info[1]) for r in caplog.records)  # logged for the owner
    status, payload, _, _ = send(in_process, "POST", "/api/analyze", GOOD)
    assert status == 200 and payload["tokens"][0]["piece"] == "5"


# ---- the command's refusals ---------------------------------------------------------------------------------------


def _would_serve(*args, **kwargs):
    raise AssertionError("deriv explore was about to serve")


@pytest.fixture
def refusing(monkeypatch):
    """A refusal that did not happen fails here instead of serving (and hanging the test)."""
    monkeypatch.setattr("deriv_lm.serving.server.run_server", _would_serve)


def test_it_refuses_a_missing_folder_a_hub_name_a_file_and_a_folder_without_config(tmp_path, capsys, refusing):
    assert "no such model folder" in cli_error(["explore", str(tmp_path / "absent")], capsys)
    assert "opens one on this machine" in cli_error(["explore", "someone/a-hub-model"], capsys)  # never downloads
    (tmp_path / "notes.txt").write_text("hello")
    assert "is a file" in cli_error(["explore", str(tmp_path / "notes.txt")], capsys)
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in cli_error(["explore", str(tmp_path / "empty")], capsys)


def test_it_refuses_a_model_that_is_not_derivs(tmp_path, capsys, refusing):
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    line = cli_error(["explore", str(tmp_path / "bert")], capsys)
    assert "holds a 'bert' model, not a Deriv one" in line and "trust" not in line


def test_it_refuses_a_port_in_use_and_a_bad_host(capsys, refusing):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        line = cli_error(["explore", str(FOLDER), "--port", str(port)], capsys)
    assert f"127.0.0.1:{port}" in line and "in use" in line
    assert "cannot be resolved" in cli_error(["explore", str(FOLDER), "--host", "no-such-host.invalid"], capsys)
    assert "--port" in cli_error(["explore", str(FOLDER), "--port", "70000"], capsys)


def test_without_the_serve_extra_it_says_how_to_install_it(capsys, monkeypatch, refusing):
    import sys

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if it were not installed
    line = cli_error(["explore", str(FOLDER)], capsys)
    assert "deriv explore needs the serve extra" in line and "pip install 'deriv-lm[serve]'" in line


def test_it_listens_on_loopback_port_8008_unless_told_otherwise():
    from deriv_lm.cli import command_parser

    parser = command_parser("explore")
    ns = parser.parse_args([str(FOLDER)])
    assert (ns.host, ns.port, ns.device) == ("127.0.0.1", 8008, "auto")
