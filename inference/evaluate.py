"""Using a trained folder: perplexity with a sliding window; translation and its BLEU / chrF."""

from __future__ import annotations

import math
import time

import torch

from ..errors import UsageError


@torch.no_grad()
def sliding_window_perplexity(model, token_ids: list[int], window: int, stride: int, progress: bool = False) -> dict:
    """exp(mean NLL) over `token_ids`, scoring each token once with up to `window` tokens of context.

    The window slides by `stride`; only the tokens not scored by the previous window count, so with
    stride < window every scored token (but the first few) sees at least window - stride tokens before it.
    """
    from tqdm.auto import tqdm

    if not 0 < stride <= window:
        raise UsageError(f"stride must lie in [1, window={window}], got {stride}")
    if len(token_ids) < 2:
        raise UsageError("Need at least 2 tokens to measure perplexity")
    ids = torch.tensor(token_ids, device=model.device)
    total_nll, total_tokens, scored_until = 0.0, 0, 0
    starts = range(0, len(ids) - 1, stride)
    for begin in tqdm(starts, desc="perplexity", disable=not progress):
        end = min(begin + window, len(ids))
        inputs = ids[begin:end][None]
        labels = inputs.clone()
        labels[:, : max(0, scored_until - begin)] = -100  # already scored by an earlier window
        targets = int((labels[:, 1:] != -100).sum())
        if targets == 0:
            continue
        loss = model(input_ids=inputs, labels=labels).loss
        total_nll += loss.item() * targets
        total_tokens += targets
        scored_until = end
        if end == len(ids):
            break
    mean = total_nll / total_tokens
    return {"loss": mean, "perplexity": math.exp(mean), "tokens": total_tokens, "window": window, "stride": stride}


@torch.no_grad()
def translate(
    model, tokenizer, sources: list[str], batch_size: int = 32, progress: bool = False, **generate_kwargs
) -> list[str]:
    """Translate `sources` through `DerivTranslationPipeline`, the code a Hub user runs (`pipeline(model=folder)`),
    with the model's generation config overridden by `generate_kwargs`.

    Sources go in batches of similar length (less padding, fewer wasted beam steps) and come back in the
    order given, `num_return_sequences` per source one after another; a source longer than the model
    reads is truncated to it.
    """
    from tqdm.auto import tqdm

    from ..modeling_deriv.pipeline_deriv import DerivTranslationPipeline

    model.eval()
    translator = DerivTranslationPipeline(model=model, tokenizer=tokenizer, batch_size=batch_size)
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    outputs = translator((sources[i] for i in order), **generate_kwargs)
    results: list[list[str]] = [[] for _ in sources]
    bar = tqdm(outputs, total=len(order), desc="translating", disable=not progress)
    for i, output in zip(order, bar, strict=True):
        results[i] = [o["translation_text"] for o in output]
    return [text for texts in results for text in texts]


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


def score(model, tokenizer, pairs: list, num_beams: int, progress: bool = False) -> dict:
    """Test BLEU and chrF with beam search, next to the copy-the-source baseline (hypothesis = source)."""
    sources, references = [p.source for p in pairs], [p.target for p in pairs]
    started = time.perf_counter()
    hypotheses = translate(model, tokenizer, sources, num_beams=num_beams, progress=progress)
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
