"""Using a trained folder: perplexity with a sliding window; translation and its BLEU / chrF.

torch is imported where it is used: the commands read this module's budgets while they parse their arguments."""

from __future__ import annotations

import argparse
import math
import os
import time

from ..errors import UsageError


# The sample that end-of-run scoring and `deriv eval` translate by default. Beam search over the 871 test pairs of
# the default run takes 13 s once the model has learned to stop, but a barely trained one decodes every pair to
# the full context with every beam (minutes to hours); 200 pairs bound that fourfold while keeping corpus BLEU
# within about a point of the whole split's (the default run: 22.5 on all 871 pairs).
TEST_SAMPLE = 200

# The tokens `deriv eval` scores by default: the held-out split of the default corpus is about 30,000 tokens for
# the tiny preset; 20,000 windows' worth of targets put the mean loss within a few hundredths of a nat.
TOKEN_BUDGET = 20_000

# Scoring lets a translation run to at most twice its source's tokens plus ten (fairseq's `--max-len-a 2
# --max-len-b 10`), within the model's context. A trained model stops long before (German runs about 1.2 times
# the English); a barely trained one never emits </s>, and without the cap decodes every short message to the full
# context with every beam, which is where a 10-step run spent its minutes.
MAX_LENGTH_A, MAX_LENGTH_B = 2, 10


def spread_sample(items: list, size: int | None) -> list:
    """`size` items taken at even steps over `items`, in their order (all of them when `size` is None or not
    smaller): a split sorted by source (the default pairs) is then sampled from its start to its end, not only
    where it begins, and the same folder always scores the same items. [a, b, c, d, e, f], 3 -> [a, c, e]."""
    if size is None or size >= len(items):
        return list(items)
    return [items[i * len(items) // size] for i in range(size)]


def progress_bar(iterable, total: int, desc: str, progress: bool):
    """tqdm's bar on a terminal; nothing where stderr is a pipe or a log, which a redrawn bar would fill with
    carriage returns (the caller says what it is doing in one line instead)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, disable=None if progress else True)  # None: off unless a TTY


def _windows(length: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window over `length` tokens: the window slides by `stride`
    and scores only the tokens no earlier window scored. 10 tokens, window 4, stride 2 ->
    [(0, 4, 1), (2, 6, 4), (4, 8, 6), (6, 10, 8)]."""
    spans, scored_until = [], 1  # the first token has no context: it is never a target
    for begin in range(0, length - 1, stride):
        end = min(begin + window, length)
        if end > scored_until:
            spans.append((begin, end, scored_until))
            scored_until = end
        if end == length:
            break
    return spans


def sliding_window_perplexity(
    model, token_ids: list[int], window: int, stride: int, progress: bool = False, batch_size: int = 8
) -> dict:
    """exp(mean NLL) over `token_ids`, scoring each token once with up to `window` tokens of context.

    The window slides by `stride`; only the tokens not scored by the previous window count, so with
    stride < window every scored token (but the first few) sees at least window - stride tokens before it.
    Windows of the same length go through the model `batch_size` at a time (no padding: only the last window
    is shorter), so the sum is the same as one window at a time up to float rounding.
    """
    import torch
    from torch.nn import functional as F

    if not 0 < stride <= window:
        raise UsageError(f"stride must lie in [1, window={window}], got {stride}")
    if len(token_ids) < 2:
        raise UsageError("Need at least 2 tokens to measure perplexity")
    ids = torch.tensor(token_ids, device=model.device)
    spans = _windows(len(ids), window, stride)
    batches = [spans[i : i + batch_size] for i in range(0, len(spans), batch_size)]
    if len(batches[-1]) > 1 and batches[-1][-1][1] - batches[-1][-1][0] < window:
        batches[-1:] = [batches[-1][:-1], batches[-1][-1:]]  # the short last window goes alone
    total_nll, total_tokens = 0.0, 0
    for batch in progress_bar(batches, len(batches), "perplexity", progress):
        inputs = torch.stack([ids[begin:end] for begin, end, _ in batch])
        labels = inputs.clone()
        for row, (begin, _, first) in enumerate(batch):
            labels[row, : first - begin] = -100  # already scored by an earlier window
        with torch.no_grad():
            logits = model(input_ids=inputs).logits.float()
        # position t predicts token t + 1
        total_nll += F.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum"
        ).item()
        total_tokens += int((labels[:, 1:] != -100).sum())
    mean = total_nll / total_tokens
    return {"loss": mean, "perplexity": math.exp(mean), "tokens": total_tokens, "window": window, "stride": stride}


def translate(
    model, tokenizer, sources: list[str], batch_size: int = 32, progress: bool = False, **generate_kwargs
) -> list[str]:
    """Translate `sources` through `DerivTranslationPipeline`, the code a Hub user runs (`pipeline(model=folder)`),
    with the model's generation config overridden by `generate_kwargs`.

    Sources go in batches of similar length (less padding, fewer wasted beam steps) and come back in the
    order given, `num_return_sequences` per source one after another; a source longer than the model
    reads is truncated to it.
    """
    from ..modeling_deriv.pipeline_deriv import DerivTranslationPipeline

    model.eval()
    translator = DerivTranslationPipeline(model=model, tokenizer=tokenizer, batch_size=batch_size)
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    outputs = translator((sources[i] for i in order), **generate_kwargs)
    results: list[list[str]] = [[] for _ in sources]
    bar = progress_bar(outputs, len(order), "translating", progress)
    for i, output in zip(order, bar, strict=True):
        results[i] = [o["translation_text"] for o in output]
    return [text for texts in results for text in texts]


def translate_within_length(
    model, tokenizer, sources: list[str], batch_size: int, progress: bool, **generate_kwargs
) -> list[str]:
    """`translate`, each batch of similar-length sources capped at MAX_LENGTH_A x its longest source's tokens +
    MAX_LENGTH_B new tokens (never more than the folder's generation config allows)."""
    lengths = [len(ids) for ids in tokenizer(sources, add_special_tokens=False)["input_ids"]]
    ceiling = model.generation_config.max_new_tokens or model.config.max_position_embeddings - 1
    order = sorted(range(len(sources)), key=lambda i: lengths[i])
    hypotheses: list[str] = [""] * len(sources)
    bar = progress_bar(None, len(sources), "translating", progress)
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        cap = min(ceiling, MAX_LENGTH_A * max(lengths[i] for i in batch) + MAX_LENGTH_B)
        texts = translate(
            model, tokenizer, [sources[i] for i in batch], batch_size, max_new_tokens=cap, **generate_kwargs
        )
        for i, text in zip(batch, texts, strict=True):
            hypotheses[i] = text
        bar.update(len(batch))
    bar.close()
    return hypotheses


def bleu_chrf(hypotheses: list[str], references: list[str]) -> dict:
    """Corpus BLEU and chrF with sacrebleu's defaults (one reference per sentence), with their signatures:
    quote the signature with the score, it says how the score was computed."""
    from sacrebleu.metrics import BLEU, CHRF

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    bleu, chrf = BLEU(), CHRF()
    return {
        "bleu": bleu.corpus_score(hypotheses, [references]).score,
        "chrf": chrf.corpus_score(hypotheses, [references]).score,
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
    }


def score(model, tokenizer, pairs: list, num_beams: int, progress: bool = False, batch_size: int = 32) -> dict:
    """Test BLEU and chrF with beam search, next to the copy-the-source baseline (hypothesis = source)."""
    sources, references = [p.source for p in pairs], [p.target for p in pairs]
    started = time.perf_counter()
    hypotheses = translate_within_length(model, tokenizer, sources, batch_size, progress, num_beams=num_beams)
    seconds = time.perf_counter() - started
    model_scores, copy_scores = bleu_chrf(hypotheses, references), bleu_chrf(sources, references)
    return {
        "test_pairs": len(pairs),
        "num_beams": num_beams,
        "bleu": model_scores["bleu"],
        "chrf": model_scores["chrf"],
        "copy_source_bleu": copy_scores["bleu"],
        "copy_source_chrf": copy_scores["chrf"],
        "bleu_signature": model_scores["bleu_signature"],
        "chrf_signature": model_scores["chrf_signature"],
        "decode_seconds": seconds,
        # five examples spread over the split (it is sorted by source, so the first few all start alike)
        "examples": [
            {"source": sources[i], "reference": references[i], "translation": hypotheses[i]}
            for i in range(0, len(pairs), max(1, len(pairs) // 5))[:5]
        ],
    }


def recorded_argument(run: dict, name: str, default=None):
    """A training argument as run.json records it, whichever concern holds it (a version-1 record: `v1`)."""
    for values in run.get("arguments", {}).values():
        if isinstance(values, dict) and name in values:
            return values[name]
    return default


def recorded_source(run: dict, folder: str) -> argparse.Namespace:
    """The corpus flags (`data.corpus.add_corpus_arguments`'s) of the run that made `folder`, from its run.json.

    run.json keeps a file outside the run folder by its name alone (`training.export.without_local_paths`), so a
    recorded file is looked for from the working directory, then in the folder; one found in neither is refused,
    naming what to do, rather than guessed at.
    """
    import glob

    files = recorded_argument(run, "files")
    if files:
        found = []
        for name in files:
            places = [p for p in (name, os.path.join(folder, name)) if glob.glob(p)]
            if not places:
                raise UsageError(
                    f"{folder}/run.json says it was trained on {name}, which is not here (run.json keeps only its "
                    "name): run `deriv eval` from the folder that holds it, or pass --files PATH to score text of "
                    "your own"
                )
            found.append(places[0])
        files = found
    return argparse.Namespace(
        files=files,
        dataset=recorded_argument(run, "dataset"),
        dataset_config=recorded_argument(run, "dataset_config"),
        split=recorded_argument(run, "split", "train"),
        text_column=recorded_argument(run, "text_column", "text"),
        streaming=False,  # the held-out documents are read into memory either way
    )


def held_out_documents(run: dict, folder: str):
    """The documents a language-model run held out for validation, split again as its run.json says (seed,
    fraction, document limit; with --streaming the stream's first documents), and the corpus they came from.
    The same functions that split them for training split them here, so they are the same documents."""
    from ..data.corpus import corpus_from_args
    from ..data.packing import split_documents
    from ..data.streaming import held_out_documents as first_documents

    corpus = corpus_from_args(recorded_source(run, folder))
    max_documents = recorded_argument(run, "max_documents")
    if recorded_argument(run, "streaming", False):
        return first_documents(corpus, recorded_argument(run, "validation_documents"), max_documents), corpus
    split = argparse.Namespace(
        max_documents=max_documents,
        cache_dir=None,  # run.json keeps the training cache's name only; the default cache serves as well
        validation_fraction=recorded_argument(run, "validation_fraction", 0.05),
        seed=recorded_argument(run, "seed"),
    )
    return split_documents(corpus, split)["test"]["text"], corpus
