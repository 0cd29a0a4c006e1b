"""A folder's chat template cannot read a file, hang or crash what renders it; a folder's tokenizer code never runs,
nor is asked about, without --trust-remote-code (issue 50, item 4).

Each test plants the hostile thing in a copy of tests/data/numbers_lm in tmp_path: a template that names another
template (include, extends, import, from-import), one that would loop 10^10 times, the cheaper bombs beside it
(a huge power, a string repeated or centred a billion times, a value that doubles, a flood of output, a macro
that calls itself), and a tokenizer_config.json whose auto_map sends AutoTokenizer to a module of the folder's
own. The fast tier renders in this process and serves in a thread; the slow tier runs `deriv chat`, `deriv serve`
and `deriv train lm --init-from` as a user would, stdin piped or a terminal."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ServerThread, cli_error, greedy_numbers_folder

from deriv_lm.serving.client import ServerProcess, send_request
from deriv_lm.tokenization.bpe import CHAT_TEMPLATE
from deriv_lm.tokenization.chat_template import (
    MAX_SECONDS,
    ChatTemplateError,
    check_chat_template,
    check_template_source,
    render_chat,
)


DATA = Path(__file__).parent / "data"
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# Renders the messages as Deriv's template does, but loops 10^10 times on a message that says "boom".
BOOBY_TRAPPED = (
    "{{ bos_token }}{% for m in messages %}{% if 'boom' in m['content'] %}" + LOOPS + "{% endif %}"
    "{{ '<|' + m['role'] + '|>\n' + m['content'] + eos_token + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
FOREIGN = {
    "include": "{% include 'secret.jinja' %}",
    "extends": "{% extends 'secret.jinja' %}",
    "import": "{% import 'secret.jinja' as secret %}{{ secret.x }}",
    "from ... import": "{% from 'secret.jinja' import x %}{{ x }}",
}
# Each stops on a budget, or fails, within a second in this process; on main each hung, ran out of memory or was
# a traceback.
BOMBS = {
    "a loop over a string, nested": "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}"
    "{% endfor %}",
    "a filtered loop that skips every item": "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s if false %}"
    "{% endfor %}{% endfor %}",
    "a power of a billion bits": "{{ 9 ** 999999999 }}",
    "a string repeated a billion times": "{{ 'x' * 1000000000 }}",
    "a string centred in a billion": "{{ 'x'|center(1000000000) }}",
    "a string method's billion": "{{ 'x'.ljust(1000000000) }}",
    "a value that doubles": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}",
    "a flood of output": "{% for i in range(100000) %}{% for j in range(100000) %}" + "x" * 200 + "{% endfor %}"
    "{% endfor %}",
    "a macro that calls itself": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "a number added to a string": "{{ 1 + 'a' }}",
}


def numbers_copy(parent: Path, name: str = "numbers") -> Path:
    folder = parent / name
    shutil.copytree(DATA / "numbers_lm", folder)
    (folder / "expected.json").unlink()
    return folder


def planted(parent: Path, template: str, name: str = "planted") -> Path:
    """A copy of the numbers folder whose chat_template.jinja is `template`, and a secret.jinja beside it that
    a template naming it would read."""
    folder = numbers_copy(parent, name)
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    (folder / "secret.jinja").write_text("{% set x = 'the secret' %}the secret", encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DATA / "numbers_lm")


def with_template(tokenizer, template: str):
    import copy

    planted_tokenizer = copy.copy(tokenizer)
    planted_tokenizer.chat_template = template
    return planted_tokenizer


# ---- the template's source: nothing names another template ----------------------------------------------------


@pytest.mark.parametrize("tag", FOREIGN)
def test_a_template_naming_another_is_refused_from_its_syntax_naming_the_folder(tag, tokenizer):
    with pytest.raises(ChatTemplateError) as refused:
        check_template_source(FOREIGN[tag], "runs/planted")
    message = str(refused.value)
    assert message.startswith("runs/planted: its chat template uses {% " + tag + " %} (line 1)"), message
    assert "\n" not in message
    with pytest.raises(ChatTemplateError, match=r"uses \{% " + tag):  # and rendering never gets that far
        render_chat(with_template(tokenizer, FOREIGN[tag]), [{"role": "user", "content": "1"}], "runs/planted")


def test_deriv_chat_refuses_a_folder_whose_template_includes_another(tmp_path, capsys, monkeypatch):
    import io

    folder = planted(tmp_path, FOREIGN["include"])
    monkeypatch.setattr(sys, "stdin", io.StringIO("1 2\n"))
    line = cli_error(["chat", str(folder)], capsys)
    assert f"{folder}: its chat template uses {{% include %}}" in line


def test_deriv_serve_refuses_such_a_folder_before_it_listens(tmp_path):
    import argparse

    from deriv_lm import serve

    folder = planted(tmp_path, FOREIGN["extends"])
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    with pytest.raises(ChatTemplateError, match=r"uses \{% extends %\}"):
        serve.load(parser.parse_args([str(folder)]), "cpu")


def test_a_syntax_error_is_one_line_naming_the_line():
    with pytest.raises(ChatTemplateError, match=r"^F: its chat template is not valid Jinja: .*\(line 2\)$"):
        check_template_source("fine\n{% for %}", "F")


@pytest.mark.parametrize(
    "template",
    [
        "{{ 1" + " + 1" * 500 + " }}",
        "{% if 1 %}" * 100 + "x" + "{% endif %}" * 100,
        "{{ " + "(" * 5000 + ")" * 5000 + " }}",
    ],
    ids=["500 additions", "100 nested ifs", "5000 parentheses"],
)
def test_a_template_nested_past_what_jinja_or_python_compiles_is_one_line(template, tokenizer):
    """On main each was a RecursionError or IndentationError traceback from the compiler."""
    with pytest.raises(ChatTemplateError, match=r"^F: its chat template is nested too deeply to be (read|compiled)$"):
        check_chat_template(with_template(tokenizer, template), "F")


# ---- the budget: nothing hangs -----------------------------------------------------------------------------------


def test_two_nested_loops_of_100000_stop_on_the_step_budget_in_a_second(tokenizer):
    started = time.monotonic()
    with pytest.raises(ChatTemplateError, match=r"^F: its chat template takes more than 1,000,000 steps to render"):
        check_chat_template(with_template(tokenizer, LOOPS), "F")
    assert time.monotonic() - started < MAX_SECONDS + 1


@pytest.mark.parametrize("what", BOMBS)
def test_each_bomb_is_one_line_in_a_second(what, tokenizer):
    started = time.monotonic()
    with pytest.raises(ChatTemplateError) as refused:
        check_chat_template(with_template(tokenizer, BOMBS[what]), "runs/x")
    assert str(refused.value).startswith("runs/x: its chat template "), refused.value
    assert "\n" not in str(refused.value)
    assert time.monotonic() - started < MAX_SECONDS + 1, what


def test_a_template_that_loops_only_on_some_messages_is_stopped_when_one_comes(tokenizer):
    trapped = with_template(tokenizer, BOOBY_TRAPPED)
    check_chat_template(trapped, "F")  # the probe passes: only the conversation shows it
    with pytest.raises(ChatTemplateError, match="steps to render"):
        render_chat(trapped, [{"role": "user", "content": "boom"}], "F", tokenize=False)


def test_within_the_budget_it_renders_what_transformers_renders(tokenizer):
    """Deriv's template, its generation marks, a control token typed as text, a raise_exception: the bounded
    rendering gives transformers' own result, ids, assistant mask and refusal alike."""
    deriv = with_template(tokenizer, CHAT_TEMPLATE)
    messages = [
        {"role": "system", "content": "4 2"},
        {"role": "user", "content": "7 <eos> 1"},
        {"role": "assistant", "content": "seven"},
    ]
    for options in (
        dict(add_generation_prompt=True, tokenize=True, return_dict=False, sanitize_control_tokens=True),
        dict(return_dict=True, return_assistant_tokens_mask=True),
        dict(tokenize=False),
    ):
        assert render_chat(deriv, messages, "F", **options) == deriv.apply_chat_template(messages, **options)
    with pytest.raises(ChatTemplateError, match="^F: its chat template refuses the conversation: Unknown chat role"):
        render_chat(deriv, [{"role": "robot", "content": "1"}], "F")


def test_outside_render_chat_transformers_compiles_as_it_always_did(tokenizer):
    """The bounded environment is Deriv's rendering only: a caller's own apply_chat_template is transformers'."""
    from transformers.utils import chat_template_utils

    render_chat(tokenizer, [{"role": "user", "content": "1"}], "F", tokenize=False)
    compiled = chat_template_utils._compile_jinja_template(tokenizer.chat_template)
    assert type(compiled.environment).__name__ == "ImmutableSandboxedEnvironment"


def test_a_request_whose_messages_trip_the_template_is_a_400_and_the_server_goes_on(tmp_path):
    folder = greedy_numbers_folder(tmp_path, 4)
    (folder / "chat_template.jinja").write_text(BOOBY_TRAPPED, encoding="utf-8")
    server = ServerThread(folder)
    try:
        chat = {"messages": [{"role": "user", "content": "boom"}], "max_tokens": 2}
        started = time.monotonic()
        status, payload, _, _ = send_request(server.port, "POST", "/v1/chat/completions", json.dumps(chat).encode())
        assert status == 400, payload
        assert payload["error"]["param"] == "messages"
        assert payload["error"]["message"].startswith("messages: the chat template takes more than"), payload
        assert time.monotonic() - started < MAX_SECONDS + 5
        assert send_request(server.port, "GET", "/health")[0] == 200
        fine = {"messages": [{"role": "user", "content": "7 1 3"}], "max_tokens": 2}
        assert send_request(server.port, "POST", "/v1/chat/completions", json.dumps(fine).encode())[0] == 200
        assert "Traceback" not in server.log_tail()
    finally:
        assert server.stop() == 0, server.log_tail()


# ---- a tokenizer of the folder's own code ------------------------------------------------------------------------


def remote_code_folder(parent: Path, where: str = "tokenizer_config.json", module: str = "") -> Path:
    """The numbers folder whose `where` maps AutoTokenizer to tokenization_evil.EvilTokenizer; the module writes a
    file named RAN when imported (and holds `module` besides)."""
    folder = numbers_copy(parent, "remote_" + where.split(".")[0])
    config = json.loads((folder / where).read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (folder / where).write_text(json.dumps(config))
    ran = folder / "RAN"
    (folder / "tokenization_evil.py").write_text(f"open({str(ran)!r}, 'w').close()\n{module}")
    return folder


@pytest.fixture
def no_question(monkeypatch):
    """transformers asks "Do you wish to run the custom code?" with input(): a test fails if it ever does."""
    import builtins

    def asked(*args):
        raise AssertionError(f"transformers asked: {args}")

    monkeypatch.setattr(builtins, "input", asked)


@pytest.mark.parametrize("where", ["tokenizer_config.json", "config.json"])
def test_a_folder_whose_tokenizer_is_its_own_code_is_refused_without_consent(where, tmp_path, no_question):
    from deriv_lm.folder.load import load_folder

    folder = remote_code_folder(tmp_path, where)
    with pytest.raises(Exception) as refused:
        load_folder(folder)
    message = str(refused.value)
    assert message == (
        f"{folder / where} maps AutoTokenizer to the folder's own code (tokenization_evil.EvilTokenizer), which "
        "would run as the tokenizer loads; if you trust its code, pass --trust-remote-code"
    )
    assert not (folder / "RAN").exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "lm", "--init-from", "{folder}", "--output-dir", "{out}", "--max-steps", "1", "--cpu"],
        ["train", "lm", "--tokenizer", "{folder}", "--output-dir", "{out}", "--max-steps", "1", "--cpu"],
        ["train", "sft", "--init-from", "{folder}", "--output-dir", "{out}", "--max-steps", "1", "--cpu"],
        ["generate", "{folder}", "1 2"],
        ["chat", "{folder}"],
        ["picture", "tokens", "{folder}", "1 2", "--out", "{out}.png"],
        ["tokenizer", "show", "{folder}", "1 2"],
    ],
    ids=lambda argv: " ".join(argv[:3]),
)
def test_every_command_that_loads_its_tokenizer_refuses_it_in_one_line(argv, tmp_path, capsys, no_question):
    folder = remote_code_folder(tmp_path)
    filled = [a.format(folder=folder, out=tmp_path / "out") for a in argv]
    line = cli_error([*filled, "--no-progress"] if argv[0] == "train" else filled, capsys)
    assert "maps AutoTokenizer to the folder's own code (tokenization_evil.EvilTokenizer)" in line, line
    assert not (folder / "RAN").exists()
    assert not (tmp_path / "out").exists()


def test_deriv_import_refuses_a_checkpoint_whose_tokenizer_is_its_own_code(tmp_path, capsys, no_question):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    source = remote_code_folder(tmp_path)
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (source / name).unlink()
    GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=64, n_embd=32, n_layer=1, n_head=4)).save_pretrained(source)
    line = cli_error(["import", str(source), "--out", str(tmp_path / "out")], capsys)
    assert "maps AutoTokenizer to the folder's own code (tokenization_evil.EvilTokenizer)" in line, line
    assert not (source / "RAN").exists()
    assert not (tmp_path / "out").exists()


def test_with_consent_a_module_without_the_class_is_one_line(tmp_path, capsys):
    folder = remote_code_folder(tmp_path)
    line = cli_error(["generate", str(folder), "1 2", "--trust-remote-code"], capsys)
    assert f"{folder}: not a model folder this command can load" in line
    assert "has no attribute 'EvilTokenizer'" in line


def test_with_consent_the_folders_own_tokenizer_loads(tmp_path, no_question):
    from deriv_lm.folder.load import load_folder

    module = "from transformers import PreTrainedTokenizerFast\nclass EvilTokenizer(PreTrainedTokenizerFast): pass\n"
    folder = remote_code_folder(tmp_path, module=module)
    loaded = load_folder(folder, trust_remote_code=True)
    assert type(loaded.tokenizer).__name__ == "EvilTokenizer"
    assert (folder / "RAN").exists()


# ---- as a user runs them -----------------------------------------------------------------------------------------


def deriv(*argv: str, stdin=subprocess.DEVNULL, timeout: float = 300, **options) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, "-m", "deriv_lm.cli", *argv],
        stdin=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        **options,
    )


def one_error_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("deriv: error: "), done.stderr
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("template", ["loops", "include"])
def test_deriv_chat_with_piped_input_exits_with_one_line(template, tmp_path):
    folder = planted(tmp_path, LOOPS if template == "loops" else FOREIGN["include"])
    done = deriv("chat", str(folder), input="1 2\n3 4\n", stdin=None)
    line = one_error_line(done)
    assert line.startswith(f"deriv: error: {folder}: its chat template "), line
    assert done.stdout == ""


@pytest.mark.slow
def test_deriv_chat_stops_on_a_message_that_trips_the_template(tmp_path):
    folder = planted(tmp_path, BOOBY_TRAPPED)
    done = deriv("chat", str(folder), "--greedy", "--max-new-tokens", "2", input="7 1 3\nboom\n", stdin=None)
    assert "takes more than 1,000,000 steps" in one_error_line(done)
    assert done.stdout.startswith("> 7 1 3\n")  # the first message was answered


@pytest.mark.slow
def test_deriv_serve_answers_a_400_keeps_answering_and_stops_on_ctrl_c(tmp_path):
    folder = greedy_numbers_folder(tmp_path, 4)
    (folder / "chat_template.jinja").write_text(BOOBY_TRAPPED, encoding="utf-8")
    server = ServerProcess(folder, log=tmp_path / "serve.log")
    try:
        boom = json.dumps({"messages": [{"role": "user", "content": "boom"}], "max_tokens": 2}).encode()
        status, payload, _ = server.send("POST", "/v1/chat/completions", boom)
        assert status == 400 and payload["error"]["param"] == "messages", payload
        assert server.send("GET", "/health")[0] == 200
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(timeout=10) == 130
    finally:
        server.stop()
    assert "Traceback" not in server.log_tail()


@pytest.mark.slow
def test_init_from_at_a_terminal_is_not_asked_about_the_folders_code(tmp_path):
    """transformers asks only when someone could answer: stdin here is a terminal, and still nothing asks."""
    import pty

    folder = remote_code_folder(tmp_path)
    primary, secondary = pty.openpty()
    try:
        argv = ["train", "lm", "--init-from", str(folder), "--output-dir", str(tmp_path / "out"), "--max-steps", "1"]
        done = deriv(*argv, "--cpu", "--no-progress", stdin=secondary, timeout=120)
    finally:
        os.close(secondary)
        os.close(primary)
    assert "maps AutoTokenizer to the folder's own code" in one_error_line(done)
    assert "[y/N]" not in done.stdout + done.stderr
    assert not (folder / "RAN").exists()
