"""Text -> token blocks for causal language modelling, with `datasets` (tokenization is cached).

    documents --split--> train / validation documents (deterministic, by seed)
              --map(tokenize, batched, num_proc)--> ids + <eos> per document
              --map(pack)--> blocks of exactly `context_length` tokens (the tail that does not fill a block is dropped)

`datasets` fingerprints every step, so a second run over the same corpus, tokenizer and block
size reads the cached Arrow files instead of tokenizing again.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

import datasets

from deriv_lm.tokenization.corpus import Corpus


def _documents(corpus: Corpus, max_documents: int | None) -> Iterator[dict]:
    for i, text in enumerate(corpus):
        if max_documents is not None and i >= max_documents:
            return
        yield {"text": text}


def _corpus_key(corpus: Corpus) -> str:
    """What identifies the corpus's contents for the cache: its description and its files' sizes and times."""
    stamp = [corpus.description]
    for path in corpus.files:
        info = os.stat(path)
        stamp.append(f"{path}:{info.st_size}:{info.st_mtime_ns}")
    return hashlib.sha256("\n".join(stamp).encode()).hexdigest()


def documents_dataset(corpus: Corpus, max_documents: int | None, cache_dir: str | None):
    """The corpus as a `datasets.Dataset` with one `text` column, cached by the corpus's identity."""
    dataset = datasets.Dataset.from_generator(
        _documents,
        gen_kwargs={"corpus": corpus, "max_documents": max_documents},
        cache_dir=cache_dir,
        # subtle: from_generator fingerprints the generator's code and arguments; the key below makes
        # a changed file or another Python's default corpus a different dataset, not a stale cache hit.
        config_name=_corpus_key(corpus)[:16],
    )
    if len(dataset) == 0:
        raise ValueError(f"The corpus is empty ({corpus.description}).")
    return dataset


def tokenize_and_pack(documents, tokenizer, context_length: int, num_proc: int | None):
    """ids of each document + <eos>, concatenated and cut into blocks of `context_length`."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("The tokenizer has no end-of-sequence token; train it with `deriv tokenizer train`.")

    def tokenize(batch):
        # split_special_tokens: a document that spells `<eos>` holds five characters, not the control token;
        # only this code puts <eos> between documents.
        ids = tokenizer(batch["text"], add_special_tokens=False, split_special_tokens=True, verbose=False)["input_ids"]
        return {"input_ids": [doc + [eos] for doc in ids]}

    def pack(batch):
        stream = [token for doc in batch["input_ids"] for token in doc]
        usable = len(stream) // context_length * context_length
        return {"input_ids": [stream[i : i + context_length] for i in range(0, usable, context_length)]}

    workers = num_proc if num_proc is not None else min(8, os.cpu_count() or 1)
    workers = max(1, min(workers, len(documents)))
    tokenized = documents.map(
        tokenize,
        batched=True,
        num_proc=workers if workers > 1 else None,
        remove_columns=documents.column_names,
        desc="tokenizing",
    )
    # One pack batch spans many documents, so only each batch's last partial block is dropped.
    return tokenized.map(pack, batched=True, batch_size=1000, desc=f"packing into blocks of {context_length}")


def lm_datasets(corpus: Corpus, tokenizer, args) -> tuple:
    """(train, validation) datasets of `input_ids` blocks, split by document before packing."""
    documents = documents_dataset(corpus, args.max_documents, args.cache_dir)
    if len(documents) < 2:
        raise ValueError(
            f"The corpus has {len(documents)} document; at least 2 are needed to hold out a validation split."
        )
    split = documents.train_test_split(test_size=args.validation_fraction, seed=args.seed, shuffle=True)
    train = tokenize_and_pack(split["train"], tokenizer, args.context_length, args.num_proc)
    validation = tokenize_and_pack(split["test"], tokenizer, args.context_length, args.num_proc)
    for name, part in (("training", train), ("validation", validation)):
        if len(part) == 0:
            raise ValueError(
                f"The {name} split is smaller than one block of {args.context_length} tokens; use a larger "
                "corpus, a shorter --context-length, or a larger --validation-fraction."
            )
    return train.with_format("torch"), validation.with_format("torch")
