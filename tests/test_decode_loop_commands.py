"""The decode loop from the commands: `deriv generate --decode-loop`, `deriv chat --decode-loop`, `deriv serve
--decode-loop`: the same text as without it, and each flag it cannot honour refused in one line (or a 400 naming the
field) before anything decodes.

The loop runs uncompiled here (`eager`, the same step function); tests/test_decode_loop.py compiles it.
"""

from __future__ import annotations

import json

import pytest
from conftest import SERVED_MESSAGES, ServerThread, cli_error, greedy_numbers_folder, served_reference

from deriv_lm import serve
from deriv_lm.cli import main


NEW_TOKENS = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return greedy_numbers_folder(tmp_path_factory.mktemp("loop"), NEW_TOKENS)


@pytest.fixture(scope="module")
def reference(folder):
    return served_reference(folder)


def generated(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("extra", [["--no-stream"], []], ids=["printed at the end", "streamed"])
def test_deriv_generate_prints_the_same_text_through_the_loop(folder, capsys, extra):
    argv = ["generate", str(folder), "5 3 1 8 :", "--greedy", *extra]
    assert generated(capsys, [*argv, "--decode-loop", "eager"]) == generated(capsys, argv)


def test_deriv_generate_samples_through_the_loop(folder, capsys):
    argv = ["generate", str(folder), "7 1", "--temperature", "0.9", "--top-k", "5", "--no-stream"]
    text = generated(capsys, [*argv, "--decode-loop", "eager", "--presence-penalty", "0.3"])
    assert text.startswith("7 1") and len(text) > len("7 1")


# (flags after `deriv generate FOLDER PROMPT --decode-loop eager`, words the one-line refusal must hold)
GENERATE_REFUSALS = [
    (["--num-beams", "2"], "not with --num-beams 2"),
    (["--frequency-penalty", "0.5"], "--frequency-penalty"),
    (["--decode-loop", "fast"], "invalid choice: 'fast'"),
]


@pytest.mark.parametrize(("flags", "words"), GENERATE_REFUSALS, ids=[" ".join(f) for f, _ in GENERATE_REFUSALS])
def test_deriv_generate_refuses_what_the_loop_cannot_do(folder, capsys, flags, words):
    line = cli_error(["generate", str(folder), "5 3", "--decode-loop", "eager", *flags], capsys)
    assert words in line


@pytest.fixture
def ngram_folder(folder, tmp_path):
    """The folder with a generation_config.json asking for something the loop does not do: n-gram blocking."""
    import shutil

    copy = tmp_path / "ngram"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**config, "no_repeat_ngram_size": 2}))
    return copy


def test_a_folder_setting_the_loop_cannot_run_is_one_line(ngram_folder, capsys):
    line = cli_error(["generate", str(ngram_folder), "5 3", "--decode-loop", "eager"], capsys)
    assert "NoRepeatNGramLogitsProcessor" in line and "--decode-loop" in line


def test_deriv_serve_refuses_such_a_folder_before_it_listens(ngram_folder, capsys):
    pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'deriv-lm[serve]')")
    sock = serve.listen("127.0.0.1", 0)  # a free port
    port = str(sock.getsockname()[1])
    sock.close()
    line = cli_error(["serve", str(ngram_folder), "--port", port, "--decode-loop", "eager"], capsys)
    assert "--decode-loop cannot serve" in line and "NoRepeatNGramLogitsProcessor" in line


def test_deriv_serve_refuses_the_loop_with_continuous_batching(folder, capsys):
    line = cli_error(["serve", str(folder), "--decode-loop", "eager", "--continuous-batching"], capsys)
    assert "--decode-loop and --continuous-batching" in line


@pytest.fixture(scope="module")
def server(folder):
    pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'deriv-lm[serve]')")
    server = ServerThread(folder, "--decode-loop", "eager")
    yield server
    server.stop()


def test_deriv_serve_answers_generates_text_through_the_loop(server, reference):
    for prompt, expected in reference["completions"].items():
        reply = server.post("/v1/completions", {"model": "numbers", "prompt": prompt, "max_tokens": NEW_TOKENS})
        assert reply["choices"][0]["text"] == expected, prompt
    chat = server.post("/v1/chat/completions", {"model": "numbers", "messages": SERVED_MESSAGES})
    assert chat["choices"][0]["message"]["content"] == reference["chat"]
    events = server.stream("/v1/completions", {"model": "numbers", "prompt": "5 3 1 8 :", "max_tokens": NEW_TOKENS})
    assert (
        "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == reference["completions"]["5 3 1 8 :"]
    )
    assert "Traceback" not in server.log_tail(10**6)


def test_deriv_serve_refuses_frequency_penalty_naming_it(server):
    body = {"model": "numbers", "prompt": "5 3", "max_tokens": 4, "frequency_penalty": 0.5}
    status, payload, _ = server.send("POST", "/v1/completions", json.dumps(body).encode())
    assert status == 400 and payload["error"]["param"] == "frequency_penalty"
    assert "--decode-loop" in payload["error"]["message"]
