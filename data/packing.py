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
import torch

from ..errors import UsageError
from .corpus import Corpus


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
    try:
        dataset = datasets.Dataset.from_generator(
            _documents,
            gen_kwargs={"corpus": corpus, "max_documents": max_documents},
            cache_dir=cache_dir,
            # subtle: from_generator fingerprints the generator's code and arguments; the key below makes
            # a changed file or another Python's default corpus a different dataset, not a stale cache hit.
            config_name=_corpus_key(corpus)[:16],
        )
    except datasets.exceptions.DatasetGenerationError as error:
        if isinstance(error.__cause__, datasets.arrow_writer.SchemaInferenceError):  # no row to infer a column from
            raise UsageError(f"The corpus is empty ({corpus.description}).") from error
        # the corpus's own error (a missing column, a file that is not UTF-8) says what is wrong; the wrapper not
        if isinstance(error.__cause__, (KeyError, ValueError, OSError)):
            raise error.__cause__ from None
        raise
    if len(dataset) == 0:
        raise UsageError(f"The corpus is empty ({corpus.description}).")
    return dataset


def tokenize_and_pack(documents, tokenizer, context_length: int, num_proc: int | None):
    """ids of each document + <eos>, concatenated and cut into blocks of `context_length`."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UsageError("The tokenizer has no end-of-sequence token; train it with `deriv tokenizer train`.")

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


def split_documents(corpus: Corpus, args):
    """The corpus's documents (at most `max_documents`) split into train / test (validation) by `seed`,
    before anything is trained on them: the tokenizer then learns from the training documents alone."""
    documents = documents_dataset(corpus, args.max_documents, args.cache_dir)
    if len(documents) < 2:
        raise UsageError(
            f"The corpus has {len(documents)} document; at least 2 are needed to hold out a validation split."
        )
    return documents.train_test_split(test_size=args.validation_fraction, seed=args.seed, shuffle=True)


def lm_datasets(documents, tokenizer, args) -> tuple:
    """(train, validation) datasets of `input_ids` blocks from `documents` (a `Corpus`, or its
    `split_documents`), split by document before packing."""
    split = split_documents(documents, args) if isinstance(documents, Corpus) else documents
    train = tokenize_and_pack(split["train"], tokenizer, args.max_position_embeddings, args.num_proc)
    validation = tokenize_and_pack(split["test"], tokenizer, args.max_position_embeddings, args.num_proc)
    for name, part in (("training", train), ("validation", validation)):
        if len(part) == 0:
            raise UsageError(
                f"The {name} split is smaller than one block of {args.max_position_embeddings} tokens; use a larger "
                "corpus, a shorter --context-length, or a larger --validation-fraction."
            )
    return train.with_format("torch"), validation.with_format("torch")


# ---- translation pairs ----------------------------------------------------------------------------------


def _pair_rows(pairs) -> Iterator[dict]:
    for pair in pairs:
        yield {"source": pair.source, "target": pair.target}


def encoded_pairs(pairs, tokenizer, max_length: int, cache_dir: str | None = None) -> tuple:
    """(dataset of `input_ids`, `labels` = target ids + <eos>, `length`; pairs dropped for length).

    Pairs longer than `max_length` on either side are dropped, never truncated: a cut target would teach
    the model to stop early. Tokenization is a cached `datasets.map`, as the language model's blocks are."""
    eos = tokenizer.eos_token_id
    key = hashlib.sha256("\n".join(f"{p.source}\t{p.target}" for p in pairs).encode()).hexdigest()[:16]
    rows = datasets.Dataset.from_generator(
        _pair_rows, gen_kwargs={"pairs": pairs}, cache_dir=cache_dir, config_name=key
    )

    def encode(batch):
        # special-token spellings in the text stay text; only this code appends <eos>
        plain = dict(add_special_tokens=False, split_special_tokens=True, verbose=False)
        sources = tokenizer(batch["source"], **plain).input_ids
        # text_target: a tokenizer with a target side of its own (Marian's second SentencePiece model) uses it
        targets = [t + [eos] for t in tokenizer(text_target=batch["target"], **plain).input_ids]
        return {
            "input_ids": sources,
            "labels": targets,
            "length": [max(len(s), len(t)) for s, t in zip(sources, targets, strict=True)],
        }

    encoded = rows.map(encode, batched=True, remove_columns=rows.column_names, desc="tokenizing pairs")
    kept = encoded.filter(lambda length: length <= max_length, input_columns="length", desc="dropping long pairs")
    return kept, len(encoded) - len(kept)


class LengthGroupedSampler(torch.utils.data.Sampler):
    """Batches of pairs of similar length, the batches in random order, as a function of (seed, epoch) so that
    a resumed run replays the epoch.

    Each epoch the pairs are shuffled, `n mod batch_size` of them set aside (they come last, for the loader's
    `drop_last`), the rest sorted by length (a stable sort, so the shuffle decides among equal lengths and a
    batch's members change between epochs), cut into batches of `batch_size`, and the batches shuffled.

    transformers' `get_length_grouped_indices` is not used: it sorts each megabatch of 50 batches from
    longest to shortest, so training sweeps from long messages to one-word ones every 50 steps. On the
    gettext pairs that sweep ended the tiny preset at 1.5 BLEU where these batches reach 20+ (docs/results.md).
    """

    def __init__(self, lengths: list[int], batch_size: int, seed: int):
        self.lengths, self.batch_size, self.seed, self.epoch = lengths, batch_size, seed, 0

    def set_epoch(self, epoch: int) -> None:  # accelerate calls it through the loader, every epoch
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        shuffled = torch.randperm(len(self.lengths), generator=generator).tolist()
        set_aside = len(shuffled) % self.batch_size
        by_length = sorted(shuffled[set_aside:], key=self.lengths.__getitem__)
        batches = [by_length[i : i + self.batch_size] for i in range(0, len(by_length), self.batch_size)]
        order = torch.randperm(len(batches), generator=generator).tolist()
        return iter([i for b in order for i in batches[b]] + shuffled[:set_aside])
