"""Text -> token blocks for causal language modelling from a stream: nothing of the corpus is written to disk.

    documents (a `datasets.IterableDataset` over the corpus, in its order)
        first `validation_documents`  -> held out, tokenized and packed in memory (the validation blocks)
        the rest (up to `max_documents` in all)
            --map(tokenize and pack, batched)--> blocks of `context_length`, `<eos>` after each document
            --shuffle(buffer, seed)--> the training stream; `set_epoch(e)` reorders each pass by (seed, e)

The blocks are those of the non-streaming path (`data.tokenize_and_pack`) for the same documents in the same
order: ids + <eos> per document, concatenated per batch of 1000 documents, each batch's partial tail dropped.
The stream has no length: the trainer runs it pass after pass until `--max-steps`.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

import datasets

from ..errors import UsageError
from .corpus import Corpus


PACK_BATCH = 1000  # documents per packing batch, as `tokenize_and_pack` (datasets' default batch size)


def stream_documents(corpus: Corpus, start: int, stop: int | None) -> Iterator[dict]:
    """Documents `start` to `stop` (None: to the end) of the corpus, as rows of one `text` column."""
    for text in islice(iter(corpus), start, stop):
        yield {"text": text}


def held_out_documents(corpus: Corpus, count: int, max_documents: int | None) -> list[str]:
    """The first `count` documents (validation), read into memory; one more is read to be sure some remain."""
    first = [row["text"] for row in stream_documents(corpus, 0, count + 1)]
    if not first:
        raise UsageError(f"The corpus is empty ({corpus.description}).")
    if len(first) <= count or (max_documents is not None and max_documents <= count):
        available = len(first) if len(first) <= count else max_documents
        raise UsageError(
            f"The stream has {available} document(s), and --validation-documents {count} holds them all out: "
            "none are left to train on; pass a smaller --validation-documents or a longer stream."
        )
    return first[:count]


def packer(tokenizer, context_length: int):
    """A batched map function: {"text": [...]} -> {"input_ids": [blocks]}, <eos> after each document."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UsageError("The tokenizer has no end-of-sequence token; train it with `deriv tokenizer train`.")

    def pack(batch: dict) -> dict:
        # split_special_tokens: a document that spells `<eos>` holds five characters, not the control token.
        ids = tokenizer(batch["text"], add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"]
        stream = [token for doc in ids for token in doc + [eos]]
        usable = len(stream) // context_length * context_length
        return {"input_ids": [stream[i : i + context_length] for i in range(0, usable, context_length)]}

    return pack


def validation_blocks(texts: list[str], tokenizer, context_length: int):
    """The held-out documents' blocks, as an in-memory `datasets.Dataset` (no cache file: it has no files)."""
    pack = packer(tokenizer, context_length)
    blocks = []
    for i in range(0, len(texts), PACK_BATCH):
        blocks += pack({"text": texts[i : i + PACK_BATCH]})["input_ids"]
    if not blocks:
        raise UsageError(
            f"The {len(texts)} validation document(s) are shorter than one block of {context_length} tokens; "
            "pass a larger --validation-documents or a shorter --context-length."
        )
    return datasets.Dataset.from_dict({"input_ids": blocks}).with_format("torch")


def training_stream(corpus: Corpus, tokenizer, args):
    """The training blocks as a `datasets.IterableDataset`: documents after the held-out ones, packed on the fly,
    shuffled in a buffer of `--shuffle-buffer` blocks (0: in the corpus's order)."""
    documents = datasets.IterableDataset.from_generator(
        stream_documents,
        gen_kwargs={"corpus": corpus, "start": args.validation_documents, "stop": args.max_documents},
    )
    blocks = documents.map(
        packer(tokenizer, args.max_position_embeddings), batched=True, batch_size=PACK_BATCH, remove_columns=["text"]
    )
    if args.shuffle_buffer:
        blocks = blocks.shuffle(seed=args.seed, buffer_size=args.shuffle_buffer)
    return blocks.with_format("torch")


def stream_datasets(corpus: Corpus, held_out: list[str], tokenizer, args) -> tuple:
    """(training stream, validation blocks)."""
    return training_stream(corpus, tokenizer, args), validation_blocks(
        held_out, tokenizer, args.max_position_embeddings
    )


def tokenizer_sample(corpus: Corpus, args) -> Iterator[str]:
    """The first `--tokenizer-sample` training documents: never a validation one."""
    stop = args.validation_documents + args.tokenizer_sample
    if args.max_documents is not None:
        stop = min(stop, args.max_documents)
    return (row["text"] for row in stream_documents(corpus, args.validation_documents, stop))
