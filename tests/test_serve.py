"""`deriv serve`: a real server on loopback, real HTTP requests, the tokens `generate()` gives.

The hostile side (a table of bad requests, the soak, a dying batching worker) is in tests/test_serve_hostile.py;
this file is what a well-behaved client gets, and what the command refuses before it listens.

Each server is `deriv serve` in its own process on 127.0.0.1, started and stopped by the fixture
(`deriv_lm.serving.client.ServerProcess`); the client is the standard library's, speaking the OpenAI protocol as `curl`
would. The folder is the numbers model of tests/data (digits in, number words out: each prompt has a different
continuation, so a reply that is not the prompt's own cannot match), with its chat template and role tokens,
and greedy generation defaults: the same settings for the server, for the server with continuous batching (which
drops the processors it does not support, such as a repetition penalty) and for `generate()` here.
"""

import concurrent.futures
import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import SERVED_MESSAGES, cli_error, greedy_numbers_folder, served_reference
from transformers import AutoModelForCausalLM

from deriv_lm.serving.client import ServerProcess


# `deriv serve` in child processes; generate() and continuous batching behind it
pytestmark = [pytest.mark.slow, pytest.mark.upstream]


pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'deriv-lm[serve]')")
pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install 'deriv-lm[serve]')")
pytest.importorskip("openai", reason="the serve extra is not installed (pip install 'deriv-lm[serve]')")

DATA = Path(__file__).parent / "data"
NEW_TOKENS = 16
MESSAGES = SERVED_MESSAGES


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return greedy_numbers_folder(tmp_path_factory.mktemp("serve"), NEW_TOKENS)


@pytest.fixture(scope="module")
def reference(folder):
    return served_reference(folder)


@pytest.fixture(scope="module", params=[(), ("--continuous-batching",)], ids=["generate", "continuous-batching"])
def server(request, folder, tmp_path_factory):
    server = ServerProcess(folder, *request.param, log=tmp_path_factory.mktemp("log") / "serve.log")
    yield server
    assert server.stop() == 0, server.log_tail()  # SIGTERM: a clean stop, batching threads included, not a kill


def completion(server, prompt: str) -> dict:
    return server.post("/v1/completions", {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0})


def test_completions_give_the_tokens_of_generate(server, reference):
    for prompt, expected in list(reference["completions"].items())[:3]:
        reply = completion(server, prompt)
        (choice,) = reply["choices"]
        assert choice["text"] == expected, prompt
        assert choice["finish_reason"] in ("stop", "length")
        assert reply["usage"]["completion_tokens"] >= 1


def test_concurrent_completions_each_get_their_own_continuation(server, reference):
    """Eight clients at once (packed into one batch under continuous batching): each reply is its prompt's."""
    prompts = list(reference["completions"])
    assert (
        len(set(reference["completions"].values())) == len(prompts) >= 8
    )  # different answers, or this proves nothing
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda prompt: completion(server, prompt), prompts))
    assert [reply["choices"][0]["text"] for reply in replies] == [reference["completions"][p] for p in prompts]


def test_chat_completion_uses_the_folders_chat_template(server, reference):
    reply = server.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": NEW_TOKENS, "temperature": 0})
    message = reply["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert message["content"] == reference["chat"]


def test_streamed_chat_completion_arrives_in_pieces_that_add_up(server, reference):
    events = server.stream("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": NEW_TOKENS, "temperature": 0})
    pieces = [event["choices"][0]["delta"].get("content") or "" for event in events if event["choices"]]
    assert sum(1 for piece in pieces if piece) >= 3  # streamed token by token, not in one piece
    assert "".join(pieces) == reference["chat"]
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_streamed_completion_adds_up_to_the_whole(server, reference):
    prompt, expected = next(iter(reference["completions"].items()))
    events = server.stream("/v1/completions", {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0})
    assert "".join(event["choices"][0].get("text") or "" for event in events if event["choices"]) == expected


def test_the_server_names_the_folder_by_its_name_and_refuses_another(server, folder):
    """The model's id is the folder's name, never the absolute path it was started with (a reply goes to other
    machines); a request may name the folder either way, and another model is 404 model_not_found."""
    with urllib.request.urlopen(f"{server.url}/v1/models", timeout=10) as reply:
        listed = json.loads(reply.read())
    assert [model["id"] for model in listed["data"]] == ["numbers"]
    assert str(folder) not in json.dumps(listed)
    for name in ("numbers", str(folder)):
        assert server.post("/v1/completions", {"model": name, "prompt": "1 2", "max_tokens": 2})["model"] == "numbers"
    with pytest.raises(urllib.error.HTTPError) as refused:
        server.post("/v1/completions", {"model": "gpt2", "prompt": "1 2", "max_tokens": 2})
    assert refused.value.code == 404
    assert json.loads(refused.value.read())["error"]["code"] == "model_not_found"


def test_a_stop_sequence_ends_the_reply_before_it(server, reference):
    prompt, expected = next(iter(reference["completions"].items()))
    stop = expected.split()[1]  # the second word of the continuation
    reply = server.post(
        "/v1/completions", {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "stop": stop}
    )
    (choice,) = reply["choices"]
    assert choice["text"] == expected[: expected.index(stop)] and choice["finish_reason"] == "stop"
    events = server.stream(
        "/v1/completions", {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "stop": [stop]}
    )
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == choice["text"]


def test_usage_and_finish_reason_count_what_was_generated(server, reference):
    prompt, expected = next(iter(reference["completions"].items()))
    reply = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 3, "temperature": 0})
    assert reply["usage"]["completion_tokens"] == 3 and reply["choices"][0]["finish_reason"] == "length"
    assert expected.startswith(reply["choices"][0]["text"])
    events = server.stream(
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": NEW_TOKENS, "temperature": 0, "stream_options": {"include_usage": True}},
    )
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] >= 1


def test_the_official_openai_client_talks_to_it(server, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="numbers", messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0)
    assert reply.choices[0].message.content == reference["chat"]
    stream = client.chat.completions.create(
        model="numbers", messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == reference["chat"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="numbers", messages=MESSAGES, temperature=-1)
    assert refused.value.body["param"] == "temperature"


def test_sampling_is_the_requests_own_and_a_seed_repeats_it(folder, tmp_path, reference):
    """Without continuous batching each request samples with its own temperature, top_p, penalties and seed:
    the same seed gives the same text, and the text is generate()'s with those settings."""
    from deriv_lm.modeling_deriv import PresencePenaltyLogitsProcessor

    server = ServerProcess(folder, log=tmp_path / "serve.log")
    try:
        body = {"prompt": "1 6 :", "max_tokens": NEW_TOKENS, "temperature": 1.5, "top_p": 0.9, "seed": 7}
        first, again = (server.post("/v1/completions", body)["choices"][0]["text"] for _ in range(2))
        assert first == again
        model, tokenizer = reference["model"], reference["tokenizer"]
        ids = torch.tensor([tokenizer("1 6 :")["input_ids"]])
        torch.manual_seed(7)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.5, top_p=0.9)
        assert first == tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        penalised = server.post(
            "/v1/completions", {"prompt": "1 6 :", "max_tokens": NEW_TOKENS, "temperature": 0, "presence_penalty": 2.0}
        )["choices"][0]["text"]
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), logits_processor=[PresencePenaltyLogitsProcessor(2.0)]
            )
        assert penalised == tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    finally:
        assert server.stop() == 0


# PEFT reads `model.is_gradient_checkpointing`, which transformers 5.24 deprecates: PEFT's call, not Deriv's
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_an_adapter_folder_is_served_merged_as_deriv_generate_runs_it(folder, tmp_path, reference, capsys):
    """A folder written by `--lora-export adapter` (base weights, adapter/ beside them): the server answers what
    `deriv generate` answers on the same folder, which merges the adapter as it loads."""
    peft = pytest.importorskip("peft")
    from deriv_lm.cli import main

    adapted = tmp_path / "adapted"
    shutil.copytree(folder, adapted)
    torch.manual_seed(0)
    lora = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(folder), peft.LoraConfig(r=4, init_lora_weights=False)
    )
    lora.save_pretrained(adapted / "adapter")
    prompt = "1 6 :"
    capsys.readouterr()
    assert (
        main(["generate", str(adapted), prompt, "--greedy", "--max-new-tokens", str(NEW_TOKENS), "--no-stream"]) == 0
    )
    generated = capsys.readouterr().out.strip()
    assert generated != prompt + reference["completions"][prompt]  # the adapter changes what the model says
    server = ServerProcess(adapted, log=tmp_path / "serve.log")
    try:
        reply = completion(server, prompt)["choices"][0]["text"]
    finally:
        assert server.stop() == 0
    assert (prompt + reply).strip() == generated


# ---- what is refused before a server starts ----------------------------------------------------------------


def test_serve_refuses_a_missing_folder_and_a_translation_model(tmp_path, capsys):
    assert "no such model folder" in cli_error(["serve", str(tmp_path / "absent")], capsys)
    line = cli_error(["serve", str(DATA / "numbers_en")], capsys)
    assert "translation model" in line and "decoder-only" in line


def test_serve_without_the_extra_says_how_to_install_it(folder, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if it were not installed
    line = cli_error(["serve", str(folder)], capsys)
    assert "pip install 'deriv-lm[serve]'" in line


def test_serve_refuses_a_port_in_use_an_unknown_host_and_a_missing_device(folder, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        line = cli_error(["serve", str(folder), "--port", str(port)], capsys)
    assert f"127.0.0.1:{port}" in line and "in use" in line
    assert "cannot be resolved" in cli_error(["serve", str(folder), "--host", "no-such-host.invalid"], capsys)
    if not torch.cuda.is_available():
        line = cli_error(["serve", str(folder), "--device", "cuda"], capsys)
        assert "--device cuda" in line and "no usable cuda" in line
    assert "not a device torch knows" in cli_error(["serve", str(folder), "--device", "gpu7"], capsys)


def test_serve_listens_on_loopback_unless_told_otherwise():
    from deriv_lm.cli import command_parser

    parser = command_parser("serve")
    assert parser.parse_args(["user/model"]).host == "127.0.0.1"
    assert parser.parse_args(["user/model", "--host", "0.0.0.0"]).host == "0.0.0.0"


def test_sigterm_stops_it_with_status_0_and_ctrl_c_with_130(folder, tmp_path):
    import signal

    server = ServerProcess(folder, log=tmp_path / "term.log")
    assert server.stop() == 0
    server = ServerProcess(folder, log=tmp_path / "int.log")
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(timeout=30) == 130
    assert "Traceback" not in server.log_tail()
