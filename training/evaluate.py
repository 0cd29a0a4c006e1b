"""Using a trained folder: perplexity with a sliding window, and generation."""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def sliding_window_perplexity(model, token_ids: list[int], window: int, stride: int, progress: bool = False) -> dict:
    """exp(mean NLL) over `token_ids`, scoring each token once with up to `window` tokens of context.

    The window slides by `stride`; only the tokens not scored by the previous window count, so with
    stride < window every scored token (but the first few) sees at least window - stride tokens before it.
    """
    from tqdm.auto import tqdm

    if not 0 < stride <= window:
        raise ValueError(f"stride must lie in [1, window={window}], got {stride}")
    if len(token_ids) < 2:
        raise ValueError("Need at least 2 tokens to measure perplexity")
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
