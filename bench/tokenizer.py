"""Tokenizer benchmark: the `tokenizers` trainer, the reference heap trainer and the naive oracle, side by side.

    deriv bench tokenizer                 # or: python -m deriv_lm.bench.tokenizer
    deriv bench tokenizer --skip-naive    # the naive recount trainer takes minutes

Rows: library training on the whole default corpus (vocab 8192); the three trainers on the same
1 MB slice (vocab 2048), each from raw text (pre-tokenization included); encoding throughput of
the trained tokenizer, one text at a time and batched. Medians of --repeats runs (the naive
trainer runs once).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ..arguments import integer, number
from ..tokenization.bpe import SMALLEST_VOCAB_SIZE
from .report import entry_point


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vocab-size",
        type=integer(minimum=SMALLEST_VOCAB_SIZE),
        default=8192,
        help="vocabulary for the whole-corpus run",
    )
    parser.add_argument(
        "--slice-mb", type=number(above=0), default=1.0, help="size of the slice the three trainers share"
    )
    parser.add_argument("--slice-vocab-size", type=integer(minimum=SMALLEST_VOCAB_SIZE), default=2048)
    parser.add_argument("--repeats", type=integer(minimum=1), default=3)
    parser.add_argument("--skip-naive", action="store_true", help="leave out the naive recount trainer")


def _median_seconds(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def run(args: argparse.Namespace) -> int:
    from ..data import default_corpus
    from ..tokenization import SPECIAL_TOKENS, reference_bpe, train_bpe
    from ..tokenization.bpe import to_transformers

    start = time.perf_counter()
    documents = list(default_corpus())
    corpus_seconds = time.perf_counter() - start
    megabytes = sum(len(d.encode("utf-8")) for d in documents) / 1e6

    rows = []  # (what, seconds, MB/s, note)
    seconds, (tokenizer, _) = _median_seconds(
        lambda: train_bpe(documents, args.vocab_size, progress=False), args.repeats
    )
    rows.append((f"library train, whole corpus, vocab {args.vocab_size}", seconds, megabytes / seconds, ""))

    slice_docs, size = [], 0
    for doc in documents:
        slice_docs.append(doc)
        size += len(doc.encode("utf-8"))
        if size >= args.slice_mb * 1e6:
            break
    slice_mb = size / 1e6
    vocab = args.slice_vocab_size
    lib, (slice_tokenizer, _) = _median_seconds(lambda: train_bpe(slice_docs, vocab, progress=False), args.repeats)

    def heap():
        return reference_bpe.train(reference_bpe.word_counts(slice_docs), vocab, SPECIAL_TOKENS)

    ref, (ref_vocab, ref_merges) = _median_seconds(heap, args.repeats)
    library_merges = [tuple(m) for m in json.loads(slice_tokenizer.to_str())["model"]["merges"]]
    same = ref_vocab == slice_tokenizer.get_vocab() and ref_merges == library_merges
    rows.append((f"library train, {slice_mb:.2f} MB slice, vocab {vocab}", lib, slice_mb / lib, "1.00x"))
    rows.append(("reference heap trainer, same slice", ref, slice_mb / ref, f"{ref / lib:.2f}x library"))
    if not args.skip_naive:
        naive, _ = _median_seconds(
            lambda: reference_bpe.train_naive(reference_bpe.word_counts(slice_docs), vocab, SPECIAL_TOKENS), 1
        )
        rows.append(
            (
                "naive recount trainer, same slice",
                naive,
                slice_mb / naive,
                f"{naive / lib:.0f}x library, {naive / ref:.0f}x heap",
            )
        )

    hf = to_transformers(tokenizer, model_max_length=10**9)  # whole documents, no length warning
    single, _ = _median_seconds(lambda: [hf(d) for d in documents], args.repeats)
    batched, _ = _median_seconds(lambda: hf(documents), args.repeats)
    rows.append(("encode, one text per call", single, megabytes / single, ""))
    rows.append(
        (
            f"encode, one batch of {len(documents)} texts",
            batched,
            megabytes / batched,
            f"{single / batched:.1f}x faster",
        )
    )

    print(f"default corpus: {len(documents)} documents, {megabytes:.2f} MB, built in {corpus_seconds:.1f} s")
    print(f"reference heap trainer's vocabulary and merges (in order) equal the library's on the slice: {same}")
    print(f"| {'what':<48} | {'seconds':>8} | {'MB/s':>7} | ratio |")
    print(f"|{'-' * 50}|{'-' * 9}:|{'-' * 8}:|-------|")
    for what, seconds, rate, note in rows:
        print(f"| {what:<48} | {seconds:>8.3f} | {rate:>7.2f} | {note} |")
    return 0


main = entry_point(__doc__, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
