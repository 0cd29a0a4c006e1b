"""`deriv serve`: a real server on loopback, real HTTP requests, the tokens `generate()` gives.

Each server is `deriv serve` in its own process on 127.0.0.1, started and stopped by the fixture
(`deriv_lm.serve.ServerProcess`); the client is the standard library's, speaking the OpenAI protocol as `curl`
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
from conftest import cli_error
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from deriv_lm.serve import ServerProcess


pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'deriv-lm[serve]')")
pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install 'deriv-lm[serve]')")
pytest.importorskip("openai", reason="the serve extra is not installed (pip install 'deriv-lm[serve]')")

DATA = Path(__file__).parent / "data"
NEW_TOKENS = 16
GREEDY = dict(do_sample=False, eos_token_id=2, pad_token_id=0, bos_token_id=1, max_new_tokens=NEW_TOKENS)
MESSAGES = [{"role": "system", "content": "4 2"}, {"role": "user", "content": "7 1 3"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve") / "numbers"
    shutil.copytree(DATA / "numbers_lm", folder)
    (folder / "expected.json").unlink()
    GenerationConfig(**GREEDY).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reference(folder):
    """What generate() gives, here, for the prompts the tests send."""
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected = json.loads((DATA / "numbers_lm" / "expected.json").read_text(encoding="utf-8"))
    prompts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in expected["prompts"]]

    def continuation(ids: list[int]) -> str:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)

    completions = {prompt: continuation(tokenizer(prompt)["input_ids"]) for prompt in prompts}
    chat_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=True)
    return {"completions": completions, "chat": continuation(chat_ids["input_ids"])}


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


def test_the_server_names_the_folder_it_serves_and_refuses_another(server, folder):
    with urllib.request.urlopen(f"{server.url}/v1/models", timeout=10) as reply:
        assert str(folder) in {model["id"] for model in json.loads(reply.read())["data"]}
    with pytest.raises(urllib.error.HTTPError) as refused:
        server.post("/v1/completions", {"model": "gpt2", "prompt": "1 2", "max_tokens": 2})
    assert refused.value.code == 400


# ---- what is refused before a server starts ----------------------------------------------------------------


def test_serve_refuses_a_missing_folder_and_a_translation_model(tmp_path, capsys):
    assert "no such model folder" in cli_error(["serve", str(tmp_path / "absent")], capsys)
    line = cli_error(["serve", str(DATA / "numbers_en")], capsys)
    assert "translation model" in line and "decoder-only" in line


def test_serve_without_the_extra_says_how_to_install_it(folder, capsys, monkeypatch):
    import transformers.utils.import_utils as import_utils

    monkeypatch.setattr(import_utils, "is_serve_available", lambda: False)
    assert "pip install 'deriv-lm[serve]'" in cli_error(["serve", str(folder)], capsys)


def test_serve_listens_on_loopback_unless_told_otherwise():
    from deriv_lm.cli import command_parser

    parser = command_parser("serve")
    assert parser.parse_args(["folder"]).host == "127.0.0.1"
    assert parser.parse_args(["folder", "--host", "0.0.0.0"]).host == "0.0.0.0"
