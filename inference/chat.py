"""`deriv chat`: a conversation with a language-model folder, kept in the folder's chat template and streamed.

Each turn renders the whole conversation with the template (`add_generation_prompt=True`), so the model reads
what it was trained on, and generates until `<eos>` ends the assistant's turn. What the user types is text:
a typed `<eos>` is five characters, not the control token (`sanitize_control_tokens`). The template is rendered
the one way Deriv renders a folder's template (`tokenization/chat_template.py`'s `render_chat`): within a budget,
so a template that would not end, or fails, is one line naming the folder.
"""

from __future__ import annotations

import sys
from typing import TextIO

from ..arguments import invalid_text
from ..tokenization.chat_template import render_chat
from .sampling import loop_refusals


RESET = "/reset"


class Conversation:
    """The messages so far, system message first; old turns are dropped from the front when the context is full."""

    def __init__(self, system: str | None = None, where: str = "the folder"):
        self.system = [{"role": "system", "content": system}] if system else []
        self.turns: list[dict] = []
        self.where = where  # the folder, named when its template fails

    @property
    def messages(self) -> list[dict]:
        return self.system + self.turns

    def reset(self) -> None:
        self.turns = []

    def ids(self, tokenizer) -> list[int]:
        """The conversation as the model reads it, ending in the `<|assistant|>` header it answers after."""
        return render_chat(
            tokenizer,
            self.messages,
            self.where,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            sanitize_control_tokens=True,
            tokenizer_kwargs={"verbose": False},  # a conversation past the context is shortened, not an error
        )

    def drop_oldest_turn(self) -> bool:
        """Forget the oldest user message and the replies to it; False when only the newest message is left."""
        users = [i for i, message in enumerate(self.turns) if message["role"] == "user"]
        if len(users) < 2:
            return False
        self.turns = self.turns[users[1] :]
        return True


def fit_to_context(conversation: Conversation, tokenizer, context: int, wanted: int) -> tuple[list[int], bool]:
    """The conversation's ids with room for `wanted` new tokens, dropping its oldest turns while it does not fit;
    also whether any were dropped. The newest message is never dropped (the reply budget shrinks instead)."""
    ids = conversation.ids(tokenizer)
    dropped = False
    while len(ids) + wanted > context and conversation.drop_oldest_turn():
        ids = conversation.ids(tokenizer)
        dropped = True
    return ids, dropped


def read_message(stdin: TextIO, prompt: bool) -> str | None:
    """One line from the user, or None at the end of input; the `you> ` prompt only for a person at a terminal
    (piped input is echoed instead, see `chat`)."""
    if prompt:
        try:
            return input("you> ")
        except EOFError:
            return None
    line = stdin.readline()
    return line.rstrip("\r\n") if line else None


def answer(model, tokenizer, ids: list[int], options: dict, processors) -> str:
    """Generate the assistant's reply to `ids`, printing it as it comes (no prompt, no control tokens)."""
    import torch
    from transformers import TextStreamer

    input_ids = torch.tensor([ids])
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    with torch.no_grad(), loop_refusals():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            logits_processor=processors,
            streamer=streamer,
            **options,
        )
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def chat(model, tokenizer, conversation: Conversation, options: dict, processors, stdin: TextIO | None = None) -> None:
    """The loop: read a message, answer it within the context, remember both; an empty line or EOF ends it.

    With piped input nobody sees what was typed, so each message is echoed as `> message` and each reply is
    followed by a blank line: the output reads as a transcript, one turn after another."""
    stdin = stdin or sys.stdin  # read when called, so a replaced sys.stdin is the one read
    if hasattr(stdin, "reconfigure"):  # a byte that is not UTF-8 becomes a message's note, not a traceback
        stdin.reconfigure(errors="surrogateescape")
    context = model.config.max_position_embeddings
    wanted = min(options.pop("max_new_tokens"), context - 1)
    told = False
    prompt = stdin.isatty()
    while (text := read_message(stdin, prompt)) is not None and text.strip():
        if text.strip() == RESET:
            conversation.reset()
            print("deriv: note: the conversation is cleared", file=sys.stderr)
            continue
        why = invalid_text(text)
        if why:
            print(f"deriv: note: that message is not valid text ({why}); type it again", file=sys.stderr)
            continue
        if not prompt:
            print(f"> {text}", flush=True)
        conversation.turns.append({"role": "user", "content": text})
        ids, dropped = fit_to_context(conversation, tokenizer, context, wanted)
        if dropped and not told:
            told = True
            print(
                f"deriv: note: the conversation outgrew the model's context of {context} tokens; "
                "its oldest turns are dropped from now on",
                file=sys.stderr,
            )
        if len(ids) >= context:
            conversation.turns.pop()
            print(
                f"deriv: note: that message is too long for the model's context of {context} tokens; shorten it",
                file=sys.stderr,
            )
            continue
        budget = {**options, "max_new_tokens": min(wanted, context - len(ids))}
        reply = answer(model, tokenizer, ids, budget, processors)
        conversation.turns.append({"role": "assistant", "content": reply})
        if not prompt:
            print(flush=True)  # the blank line that ends a turn in the transcript
