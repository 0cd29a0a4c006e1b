"""Presence and frequency penalties (the OpenAI API's two penalties) as `LogitsProcessor`s.

transformers has `repetition_penalty` (a multiplicative penalty, Keskar et al. 2019) but not these
two additive ones. Use them through `generate(logits_processor=LogitsProcessorList([...]))`.
Counts are over the whole sequence the processor sees: the prompt and what has been generated.
"""

import math

import torch
from transformers import LogitsProcessor


def _check_penalty(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite number, got {value!r}.")
    return float(value)


class PresencePenaltyLogitsProcessor(LogitsProcessor):
    """logit[v] <- logit[v] - p * [v occurs in the sequence so far]."""

    def __init__(self, presence_penalty: float):
        self.presence_penalty = _check_penalty("presence_penalty", presence_penalty)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        present = torch.zeros_like(scores).scatter_(1, input_ids, 1.0)  # (B, V) of 0/1
        return scores - self.presence_penalty * present


class FrequencyPenaltyLogitsProcessor(LogitsProcessor):
    """logit[v] <- logit[v] - f * count(v in the sequence so far)."""

    def __init__(self, frequency_penalty: float):
        self.frequency_penalty = _check_penalty("frequency_penalty", frequency_penalty)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.zeros_like(scores).scatter_add_(1, input_ids, torch.ones_like(input_ids, dtype=scores.dtype))
        return scores - self.frequency_penalty * counts


__all__ = ["PresencePenaltyLogitsProcessor", "FrequencyPenaltyLogitsProcessor"]
