"""The decode loop from the commands: `deriv generate --decode-loop`, `deriv chat --decode-loop`, `deriv serve
--decode-loop`: the loop ran (its steps counted, `LoopRuns`: the same text as without it proves nothing alone, since
generate()'s own loop gives it too), with the flags' settings, the same text as without it, and each flag it cannot
honour refused in one line (or a 400 naming the field) before anything decodes.

The loop runs uncompiled here (`eager`, the same step function); tests/test_decode_loop.py compiles it.
"""

from __future__ import annotations

import json

import pytest
from conftest import SERVED_MESSAGES, ServerThread, cli_error, greedy_numbers_folder, served_reference
from test_decode_loop import LoopRuns

from deriv_lm.cli import main
from deriv_lm.serving.server import listen


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
def test_deriv_generate_prints_the_same_text_through_the_loop(folder, capsys, monkeypatch, extra):
    """The folder's NEW_TOKENS tokens, all but the first from the loop's steps (one block), and generate()'s text;
    without the flag the loop does not run."""
    argv = ["generate", str(folder), "5 3 1 8 :", "--greedy", *extra]
    loop = LoopRuns(monkeypatch)
    through_the_loop = generated(capsys, [*argv, "--decode-loop", "eager"])
    assert (len(loop.runs), loop.steps) == (1, NEW_TOKENS - 1), "--decode-loop ran the loop"
    assert through_the_loop == generated(capsys, argv)
    assert (len(loop.runs), loop.steps) == (1, NEW_TOKENS - 1), "no flag, no loop"


def test_deriv_generate_samples_through_the_loop(folder, capsys, monkeypatch):
    """Sampling in the loop's steps, with the flags' temperature, top-k and presence penalty as the step's settings
    (the loop's random numbers are not generate()'s: the text cannot be compared)."""
    argv = ["generate", str(folder), "7 1", "--temperature", "0.9", "--top-k", "5", "--no-stream"]
    loop = LoopRuns(monkeypatch)
    text = generated(capsys, [*argv, "--decode-loop", "eager", "--presence-penalty", "0.3"])
    assert text.startswith("7 1") and len(text) > len("7 1")
    assert (len(loop.runs), loop.steps) == (1, NEW_TOKENS - 1)
    assert loop.mode(0)[0], "sampled, not greedy"
    settings = {name: loop.setting(0, name) for name in ("temperature", "top_k", "presence")}
    assert settings == {"temperature": pytest.approx(0.9), "top_k": 5, "presence": pytest.approx(0.3)}


def test_deriv_generate_applies_every_penalty_in_the_loop(folder, capsys, monkeypatch):
    """The frequency penalty too (the loop counts only the tokens written so far): generate()'s text, from the
    loop's steps with the three penalties as its settings."""
    argv = ["generate", str(folder), "5 3 1 8 :", "--greedy", "--no-stream", "--frequency-penalty", "1.5"]
    argv += ["--presence-penalty", "0.5", "--repetition-penalty", "1.3"]
    loop = LoopRuns(monkeypatch)
    assert generated(capsys, [*argv, "--decode-loop", "eager"]) == generated(capsys, argv)
    assert (len(loop.runs), loop.steps) == (1, NEW_TOKENS - 1)
    settings = {name: loop.setting(0, name) for name in ("frequency", "presence", "repetition")}
    assert settings == pytest.approx({"frequency": 1.5, "presence": 0.5, "repetition": 1.3})
    assert loop.mode(0) == (False, True, False), "greedy, penalised"


# (flags after `deriv generate FOLDER PROMPT --decode-loop eager`, words the one-line refusal must hold)
GENERATE_REFUSALS = [
    (["--num-beams", "2"], "not with --num-beams 2"),
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


def test_deriv_serve_refuses_such_a_folder_before_it_listens(ngram_folder, capsys, monkeypatch):
    pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'deriv-lm[serve]')")
    from deriv_lm.serving import server

    def served(*args, **kwargs):  # a serve that got this far would answer forever: fail instead of hanging
        raise AssertionError("deriv serve started serving a folder the loop cannot serve")

    monkeypatch.setattr(server, "run_server", served)
    sock = listen("127.0.0.1", 0)  # a free port
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


def test_deriv_serve_answers_generates_text_through_the_loop(server, reference, monkeypatch):
    """Each request (completions, chat, streamed) decoded in the loop's steps, greedily, and generate()'s text."""
    loop = LoopRuns(monkeypatch)
    for prompt, expected in reference["completions"].items():
        reply = server.post("/v1/completions", {"model": "numbers", "prompt": prompt, "max_tokens": NEW_TOKENS})
        assert reply["choices"][0]["text"] == expected, prompt
    chat = server.post("/v1/chat/completions", {"model": "numbers", "messages": SERVED_MESSAGES})
    assert chat["choices"][0]["message"]["content"] == reference["chat"]
    events = server.stream("/v1/completions", {"model": "numbers", "prompt": "5 3 1 8 :", "max_tokens": NEW_TOKENS})
    assert (
        "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == reference["completions"]["5 3 1 8 :"]
    )
    requests = len(reference["completions"]) + 2
    assert (len(loop.runs), loop.steps) == (requests, requests * (NEW_TOKENS - 1)), "every request ran the loop"
    assert not any(loop.mode(run)[0] for run in range(requests)), "greedily, as the folder decodes"
    assert "Traceback" not in server.log_tail(10**6)


def test_deriv_serve_applies_the_penalties_in_the_loop(server, reference, monkeypatch):
    """presence_penalty and frequency_penalty through the loop (its steps, with the two as settings): generate()'s
    text with the same two processors."""
    import torch
    from transformers import LogitsProcessorList

    from deriv_lm.modeling_deriv import FrequencyPenaltyLogitsProcessor, PresencePenaltyLogitsProcessor

    model, tokenizer, text = reference["model"], reference["tokenizer"], "5 3 1 8 :"
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids
    processors = LogitsProcessorList([PresencePenaltyLogitsProcessor(0.5), FrequencyPenaltyLogitsProcessor(1.5)])
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)), logits_processor=processors)
    expected = tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    body = {"model": "numbers", "prompt": text, "max_tokens": NEW_TOKENS, "presence_penalty": 0.5}
    loop = LoopRuns(monkeypatch)
    reply = server.post("/v1/completions", {**body, "frequency_penalty": 1.5})
    assert reply["choices"][0]["text"] == expected
    assert (len(loop.runs), loop.steps) == (1, NEW_TOKENS - 1)
    settings = {name: loop.setting(0, name) for name in ("presence", "frequency")}
    assert settings == pytest.approx({"presence": 0.5, "frequency": 1.5})
    assert expected != reference["completions"][text], "the penalties must matter for this test to mean anything"


def test_a_request_the_loop_refuses_runs_in_generate_said_once(server, reference, monkeypatch):
    """The engine's net under the loop: settings the loop refuses (here n-gram blocking, which no request can ask
    for today) run in generate()'s own loop, one log line, generate()'s tokens, never a failed request."""
    import asyncio

    import torch

    from deriv_lm.serving.engines import END, Job

    ids = reference["tokenizer"]("5 3 1 8 :", add_special_tokens=False).input_ids

    async def decode() -> list[int]:
        job, tokens = Job(ids, NEW_TOKENS), []
        server.served.engine.submit(job, {"no_repeat_ngram_size": 2})
        while (item := await job.queue.get()) is not END:
            assert isinstance(item, list), item
            tokens += item
        return tokens

    with torch.no_grad():
        out = reference["model"].generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)), no_repeat_ngram_size=2
        )
    loop = LoopRuns(monkeypatch)
    assert asyncio.run(decode()) == out[0, len(ids) :].tolist()
    assert loop.runs == [], "refused before the loop ran a step"
    log = server.log_tail(10**6)
    assert log.count("generate() runs this request") == 1 and "NoRepeatNGramLogitsProcessor" in log
    assert "Traceback" not in log


def test_the_flag_offers_exactly_the_loops_the_loop_runs():
    """--decode-loop's choices are a copy (the parser cannot import torch): a loop added or renamed in
    decode_loop.LOOPS without the flag, or the other way round, fails here."""
    from deriv_lm.inference.sampling import DECODE_LOOPS
    from deriv_lm.modeling_deriv.decode_loop import LOOPS

    assert DECODE_LOOPS == LOOPS


@pytest.mark.parametrize("presence, frequency", [(0.0, 0.0), (0.5, 0.0), (0.0, -1.5), (1.0, 2.0)])
def test_every_surface_builds_the_penalties_the_loop_runs(presence, frequency):
    """deriv generate, chat, serve and explore take their penalties from one rule (decode_loop.penalty_processors):
    the processors are the same, in the order the loop accepts, each only when it is not 0."""
    import argparse

    from deriv_lm.inference.sampling import penalty_processors
    from deriv_lm.modeling_deriv.decode_loop import check_processors
    from deriv_lm.viz.explorer.compute import _user_processors

    def described(processors) -> list[tuple[str, float]]:
        return [(type(p).__name__, next(v for k, v in vars(p).items() if k.endswith("_penalty"))) for p in processors]

    expected = [(name, value) for name, value in (("Presence", presence), ("Frequency", frequency)) if value]
    expected = [(f"{name}PenaltyLogitsProcessor", value) for name, value in expected]
    cli = penalty_processors(argparse.Namespace(presence_penalty=presence, frequency_penalty=frequency))
    page = _user_processors({"presence_penalty": presence, "frequency_penalty": frequency})
    assert described(cli) == described(page) == expected
    check_processors(cli)  # in the loop's order: it would refuse them otherwise
    served = served_processors(presence, frequency)
    assert described(served or []) == expected and (served is None) == (not expected)


def served_processors(presence: float, frequency: float):
    """The processors `deriv serve` hands its engine for a request with these penalties."""
    pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'deriv-lm[serve]')")
    from types import SimpleNamespace

    from deriv_lm.serving.app import sampling_settings
    from deriv_lm.serving.protocol import CompletionRequest

    generation = SimpleNamespace(do_sample=False)
    served = SimpleNamespace(generation=generation, engine=SimpleNamespace(batching=False))
    request = CompletionRequest.model_validate(
        {"prompt": "1", "presence_penalty": presence, "frequency_penalty": frequency}
    )
    return sampling_settings(served, request)[1]
