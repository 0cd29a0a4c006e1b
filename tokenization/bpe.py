"""Train a byte-level BPE tokenizer with `tokenizers` and save it as a Hugging Face tokenizer folder.

The tokenizer is GPT-2's design: text is split by GPT-2's regex, each piece is spelled in 256 byte
symbols (so no input is ever unknown), and BPE merges are learned on top. Special tokens get fixed
ids at the front of the vocabulary, the same on every retraining:

    0 <pad>   1 <bos>   2 <eos>   3 <|system|>   4 <|user|>   5 <|assistant|>   6.. extra tokens

Nothing is added to plain text automatically (`tokenizer(text)` returns just its tokens, as with
GPT-2); the language-model data pipeline appends <eos> after each document, and the chat template
writes <bos>, the role tokens and <eos> around messages.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm.auto import tqdm

from ..errors import UsageError
from ..folder.atomic import atomic_directory


PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SPECIAL_TOKENS = [PAD, BOS, EOS, *ROLE_TOKENS]
BYTE_ALPHABET_SIZE = 256
SMALLEST_VOCAB_SIZE = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
# Far past any model's vocabulary (Gemma's is 256 k); a larger one makes the Rust trainer abort the process.
LARGEST_VOCAB_SIZE = 1 << 20

# One message per block: <|role|>\n content <eos>\n, after a single <bos>; an unknown role is an error. What the
# assistant says, and the <eos> that ends its turn, sits inside {% generation %}: the rendered text is the same, and
# `apply_chat_template(..., return_assistant_tokens_mask=True)` marks those tokens, the ones a chat fine-tune learns
# (the <eos> too, or the model never learns to stop; the <|assistant|> header is the prompt's, not the reply's).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown chat role ' + message['role'] + ': use system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
# The template before it marked the assistant's tokens (folders made before issue 19 carry it): the same text.
CHAT_TEMPLATE_WITHOUT_MARKS = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown chat role ' + message['role'] + ': use system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def chat_template_with_generation_marks(template: str | None) -> str | None:
    """Deriv's current template in place of its old default, which renders the same text but cannot give the
    assistant-token mask; any other template (the user's own, or None) is returned as it is, since only its
    author knows which of its tokens are the assistant's."""
    return CHAT_TEMPLATE if template == CHAT_TEMPLATE_WITHOUT_MARKS else template


def special_tokens_with(extra: Iterable[str] = ()) -> list[str]:
    """The fixed special tokens, then `extra` ones (ids 6, 7, ...) in the order given, without repeats."""
    tokens = list(SPECIAL_TOKENS)
    for token in extra:
        if not token or token.isspace():
            raise UsageError(f"A special token must be a non-empty string, got {token!r}")
        if token not in tokens:
            tokens.append(token)
    return tokens


def byte_level_tokenizer(model: models.BPE) -> Tokenizer:
    """The pipeline around a BPE model: GPT-2 split + byte symbols in, bytes back out."""
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)  # keeps character offsets right
    return tokenizer


@dataclass
class TrainingSummary:
    vocab_size: int
    documents: int
    characters: int
    seconds: float

    @property
    def megabytes_per_second(self) -> float:
        return self.characters / 1e6 / max(self.seconds, 1e-9)


def train_bpe(
    documents: Iterable[str],
    vocab_size: int,
    special_tokens: list[str] | None = None,
    progress: bool = True,
) -> tuple[Tokenizer, TrainingSummary]:
    """Learn a byte-level BPE vocabulary of `vocab_size` ids from `documents` with the `tokenizers` trainer."""
    special_tokens = SPECIAL_TOKENS if special_tokens is None else special_tokens
    smallest = BYTE_ALPHABET_SIZE + len(special_tokens)
    if not isinstance(vocab_size, int) or vocab_size < smallest:
        raise UsageError(
            f"vocab_size={vocab_size} cannot hold the {BYTE_ALPHABET_SIZE} byte symbols and the "
            f"{len(special_tokens)} special tokens; use at least {smallest} (a few thousand is typical)."
        )
    if vocab_size > LARGEST_VOCAB_SIZE:
        raise UsageError(f"vocab_size={vocab_size} is larger than {LARGEST_VOCAB_SIZE}, more than any model uses")
    seen = {"documents": 0, "characters": 0}

    def counted(texts: Iterable[str]) -> Iterator[str]:
        # `with`: a bad file raises inside the loop, and the bar must end its line before the error is printed
        with tqdm(desc="reading corpus", unit=" chars", unit_scale=True, disable=not progress, mininterval=0.5) as bar:
            for text in texts:
                seen["documents"] += 1
                seen["characters"] += len(text)
                bar.update(len(text))
                yield text

    tokenizer = byte_level_tokenizer(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # tqdm above; the Rust bars garble logs that are not terminals
    )
    start = time.perf_counter()
    tokenizer.train_from_iterator(counted(documents), trainer)
    seconds = time.perf_counter() - start
    if seen["characters"] == 0:
        raise UsageError("The corpus is empty: no document had any text to learn from.")
    summary = TrainingSummary(tokenizer.get_vocab_size(), seen["documents"], seen["characters"], seconds)
    return tokenizer, summary


def to_transformers(tokenizer: Tokenizer, model_max_length: int = 1024):
    """Wrap a `tokenizers.Tokenizer` for transformers: special tokens named, left padding, the chat template."""
    from transformers import PreTrainedTokenizerFast

    vocab = tokenizer.get_vocab()
    missing = [t for t in (PAD, BOS, EOS) if t not in vocab]
    if missing:
        raise UsageError(f"The tokenizer lacks the special tokens {missing}; train it with train_bpe().")
    extra = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.content not in SPECIAL_TOKENS]
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        additional_special_tokens=ROLE_TOKENS + extra,
        padding_side="left",  # generation appends on the right, so batches pad on the left
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(
    tokenizer: Tokenizer, folder: str | os.PathLike, model_max_length: int = 1024, allow_existing: bool = False
) -> None:
    """Write `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` into `folder`, atomically.

    The folder appears complete or not at all: files are written to a temporary folder beside it
    and moved into place at the end, so an interruption never leaves a half-written tokenizer. `folder` is new,
    empty or Deriv's (a model folder: its tokenizer files are replaced), or, with `allow_existing`, a folder of
    the user's whose files are kept and never replaced (`folder.target`).
    """
    hf_tokenizer = to_transformers(tokenizer, model_max_length)
    with atomic_directory(folder, allow_existing=allow_existing) as tmp:
        hf_tokenizer.save_pretrained(tmp)
        make_portable(tmp)


def make_portable(folder: str | os.PathLike) -> None:
    """Let transformers 4.x read the folder too.

    transformers 5 writes `"tokenizer_class": "TokenizersBackend"`, a name 4.x does not know, and
    keeps the chat template only in `chat_template.jinja`; 4.x reads `PreTrainedTokenizerFast`
    and (before 4.50) the template from `tokenizer_config.json`. Both readers accept this form.
    """
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):  # a SentencePiece one (OPUS-MT's) keeps its class
        return
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.setdefault("chat_template", CHAT_TEMPLATE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")


def characters_per_token(tokenizer, documents: list[str]) -> float:
    """Characters of text per token: how much each token of the model's context carries."""
    if not hasattr(tokenizer, "backend_tokenizer"):  # a SentencePiece tokenizer (an imported OPUS-MT's)
        tokens = sum(map(len, tokenizer(documents, add_special_tokens=False).input_ids))
        return sum(map(len, documents)) / max(1, tokens)
    # subtle: a batched `tokenizer(..., padding=True)` leaves padding (and truncation) switched on in the
    # backend, and encode_batch would then count pad tokens; measure with a clean copy.
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_padding()
    backend.no_truncation()
    encodings = backend.encode_batch(documents, add_special_tokens=False)
    tokens = sum(len(e.ids) for e in encodings)
    return sum(map(len, documents)) / max(1, tokens)
