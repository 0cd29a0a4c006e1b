"""`deriv chat` driven through stdin, and `pipeline("text-generation")` with messages, on tests/data/numbers_lm.

The numbers model was trained on "5 3 1 8 : five thousand three hundred eighteen<eos>" documents, packed. A copy
whose chat template writes a conversation in that form (the user's digits, then the reply and its <eos>) answers
each message and ends its turn at <eos>, so the replies say whether the loop kept the conversation."""

import io
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import cli_error
from transformers import AutoTokenizer

from deriv_lm.cli import main
from deriv_lm.folder.load import load_folder
from deriv_lm.inference import chat as chat_module


DATA = Path(__file__).parent / "data"
# The training documents' form, as a chat template: a reply is its text and <eos>, a message its text alone.
NUMBERS_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] + eos_token }}"
    "{% elif m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
)
GREEDY = ["--greedy", "--repetition-penalty", "1.0"]


@pytest.fixture(scope="module")
def numbers_chat(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("chat") / "numbers_chat"
    shutil.copytree(DATA / "numbers_lm", folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = NUMBERS_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def loaded(numbers_chat):
    return load_folder(numbers_chat, seq2seq=False)


@pytest.fixture
def seen(monkeypatch) -> list[list[int]]:
    """The ids each turn gives the model: the conversation as rendered when the message came."""
    ids_per_turn: list[list[int]] = []
    answer = chat_module.answer

    def spy(model, tokenizer, ids, options, processors):
        ids_per_turn.append(list(ids))
        return answer(model, tokenizer, ids, options, processors)

    monkeypatch.setattr(chat_module, "answer", spy)
    return ids_per_turn


def chat(folder, lines: str, *flags, capsys, monkeypatch) -> tuple[str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    capsys.readouterr()
    assert main(["chat", str(folder), *flags]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def transcript(out: str) -> list[tuple[str, str]]:
    """(message, reply) per turn of a piped chat's output: `> message`, the reply, a blank line."""
    assert out.endswith("\n\n") or not out, out
    turns = []
    for block in out.removesuffix("\n\n").split("\n\n") if out else []:
        echo, _, reply = block.partition("\n")
        assert echo.startswith("> "), block
        turns.append((echo.removeprefix("> "), reply))
    return turns


def greedy_reply(loaded, messages: list[dict], max_new_tokens: int = 32) -> tuple[str, list[int]]:
    """The reply `generate()` gives to the conversation rendered in the template, and its new ids."""
    ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        out = loaded.model.generate(
            torch.tensor([ids]), do_sample=False, repetition_penalty=1.0, max_new_tokens=max_new_tokens
        )
    new = out[0, len(ids) :].tolist()
    return loaded.tokenizer.decode(new, skip_special_tokens=True), new


def test_each_reply_is_generate_on_the_conversation_so_far(numbers_chat, loaded, seen, capsys, monkeypatch):
    out, _ = chat(numbers_chat, "5 3 1 8 :\n7 2 :\n", *GREEDY, capsys=capsys, monkeypatch=monkeypatch)
    messages, expected = [], []
    for number, text in enumerate(["5 3 1 8 :", "7 2 :"]):
        messages.append({"role": "user", "content": text})
        rendered = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        assert seen[number] == rendered  # the whole conversation, earlier reply included
        reply, new = greedy_reply(loaded, messages)
        assert new[-1] == loaded.tokenizer.eos_token_id and len(new) < 32  # the turn ended at <eos>
        messages.append({"role": "assistant", "content": reply})
        expected.append((text, reply))
    assert transcript(out) == expected and "five thousand" in out and "seventy two" in out
    assert "<eos>" not in out and "you>" not in out  # piped input: no prompt


def test_piped_input_reads_as_a_transcript(numbers_chat, capsys, monkeypatch):
    """Nobody sees piped input, so each message is echoed before its reply and a blank line ends each turn."""
    out, _ = chat(numbers_chat, "5 3 1 8 :\n7 2 :\n", *GREEDY, capsys=capsys, monkeypatch=monkeypatch)
    assert out == "> 5 3 1 8 :\n five thousand three hundred eighteen\n\n> 7 2 :\n seventy two\n\n"


def test_a_conversation_past_the_context_drops_its_oldest_turns(numbers_chat, loaded, seen, capsys, monkeypatch):
    lines = "5 3 1 8 :\n7 2 :\n4 4 4 :\n9 0 1 :\n6 6 :\n"
    out, err = chat(numbers_chat, lines, *GREEDY, capsys=capsys, monkeypatch=monkeypatch)
    turns = transcript(out)
    assert len(turns) == 5 and turns[-1] == ("6 6 :", " sixty six")
    assert err.count("its oldest turns are dropped") == 1  # said once
    assert all(len(ids) + 32 <= 64 for ids in seen)  # every turn left room for the reply
    last = loaded.tokenizer.decode(seen[-1])
    assert "5 3 1 8" not in last and last.startswith("4 4 4 :") and last.endswith("6 6 :")  # the oldest turns went


def test_reset_and_an_empty_line(numbers_chat, loaded, seen, capsys, monkeypatch):
    out, err = chat(
        numbers_chat, "5 3 1 8 :\n/reset\n7 2 :\n\n4 4 :\n", *GREEDY, capsys=capsys, monkeypatch=monkeypatch
    )
    assert "cleared" in err and len(seen) == 2  # the empty line ended the conversation before "4 4 :"
    fresh = [{"role": "user", "content": "7 2 :"}]
    assert seen[1] == loaded.tokenizer.apply_chat_template(fresh, add_generation_prompt=True, return_dict=False)
    assert transcript(out)[-1] == ("7 2 :", greedy_reply(loaded, fresh)[0])


def test_a_message_that_is_not_utf8_is_noted_and_the_chat_goes_on(numbers_chat, seen, capsys, monkeypatch):
    """Bytes that are not UTF-8 on stdin (a pasted Latin-1 line) are one note, and the next message is answered."""
    stdin = io.TextIOWrapper(io.BytesIO(b"5 3 1 8 :\n7 \xff 2 :\n7 2 :\n"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", stdin)
    capsys.readouterr()
    assert main(["chat", str(numbers_chat), *GREEDY]) == 0
    out, err = capsys.readouterr()
    assert [message for message, _ in transcript(out)] == ["5 3 1 8 :", "7 2 :"] and len(seen) == 2
    assert "that message is not valid text (the byte 0xff, which is not UTF-8 at character 2)" in err


def test_an_old_folder_chats_with_a_system_message_and_typed_eos_is_text(seen, capsys, monkeypatch):
    folder = DATA / "numbers_lm"  # its template is the one saved before the generation marks
    flags = [*GREEDY, "--max-new-tokens", "3", "--system", "Be brief."]
    out, _ = chat(folder, "hi <eos>\nagain\n", *flags, capsys=capsys, monkeypatch=monkeypatch)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.decode(seen[0]) == "<bos><|system|>\nBe brief.<eos>\n<|user|>\nhi <eos><eos>\n<|assistant|>\n"
    assert seen[0].count(tokenizer.eos_token_id) == 2  # the typed <eos> is five characters, not the token
    assert len(seen[1]) > len(seen[0]) + 5  # (the model's reply to chat is noise)
    assert [message for message, _ in transcript(out)] == ["hi <eos>", "again"]


def test_sampling_flags_are_honoured(numbers_chat, loaded, capsys, monkeypatch):
    messages = [{"role": "user", "content": "5 3 1 8 :"}]
    short, _ = chat(
        numbers_chat, "5 3 1 8 :\n", "--max-new-tokens", "2", *GREEDY, capsys=capsys, monkeypatch=monkeypatch
    )
    [(_, short)] = transcript(short)
    assert short == greedy_reply(loaded, messages, max_new_tokens=2)[0]
    assert greedy_reply(loaded, messages)[0].startswith(short) and len(short) < 12  # cut short
    hot = ["--temperature", "5", "--top-k", "0"]
    runs = {chat(numbers_chat, "5 3 :\n", *hot, "--seed", s, capsys=capsys, monkeypatch=monkeypatch)[0] for s in "001"}
    assert len(runs) == 2  # the same seed samples the same reply, another seed another


def test_a_translation_folder_or_one_without_a_template_is_refused(tmp_path, capsys):
    assert "needs a language model" in cli_error(["chat", str(DATA / "numbers_en")], capsys)
    folder = tmp_path / "no_template"
    shutil.copytree(DATA / "numbers_lm", folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(folder)
    assert "has no chat template" in cli_error(["chat", str(folder)], capsys)


def test_the_pipeline_answers_a_list_of_messages(numbers_chat, loaded):
    from transformers import pipeline

    messages = [{"role": "user", "content": "5 3 1 8 :"}]
    result = pipeline("text-generation", model=str(numbers_chat))(messages, do_sample=False, repetition_penalty=1.0)
    conversation = result[0]["generated_text"]
    assert conversation[:-1] == messages
    assert conversation[-1] == {"role": "assistant", "content": greedy_reply(loaded, messages)[0]}
    assert "five thousand" in conversation[-1]["content"]
