"""Where a library's own piece replaced (or was found not to match) a hand-written one: the two agree on the
inputs that matter, or the test says where and why they differ (issue 30, item 5)."""

import math

import pytest
import torch


# ---- learning-rate schedules ---------------------------------------------------------------------------

# (warmup, steps, min_lr_ratio) of the presets that use the cosine, and the warmups of those that use the paper's
TINY_COSINE = (60, 600, 0.1)
TINY_INVERSE_SQRT = 200


def learning_rates(make_scheduler, steps: int) -> list[float]:
    """The learning rate of each optimizer step 0 .. steps-1 (lr_max 1), as a run steps its scheduler."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = make_scheduler(optimizer)
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return rates


def cosine_reference(step: int, warmup: int, total: int, floor: float) -> float:
    """The equation, in float64: warmup (step + 1) / warmup, then a half cosine from 1 down to `floor`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def inverse_sqrt_reference(step: int, warmup: int) -> float:
    """Vaswani et al. §5.3 over lr_max, steps counted from 1: min(n / warmup, sqrt(warmup / n))."""
    n = step + 1
    return min(n / warmup, math.sqrt(warmup / n))


def ours(schedule):
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def test_the_cosine_schedule_is_its_equation_at_every_step():
    from deriv_lm.training.optim import warmup_cosine

    warmup, total, floor = TINY_COSINE
    rates = learning_rates(ours(warmup_cosine(warmup, total, floor)), total)
    assert rates == [cosine_reference(step, warmup, total, floor) for step in range(total)]


def test_the_inverse_sqrt_schedule_is_the_papers_at_every_step():
    from deriv_lm.training.optim import inverse_sqrt

    rates = learning_rates(ours(inverse_sqrt(TINY_INVERSE_SQRT)), 2000)
    assert rates == [inverse_sqrt_reference(step, TINY_INVERSE_SQRT) for step in range(2000)]


def test_transformers_cosine_differs_from_ours_in_the_warmup_only():
    """Why training/optim.py keeps its own: the library warms up from lr 0 (step / warmup), one step behind;
    after the warmup the two are equal bit for bit. If the library ever matches, switch to it."""
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    warmup, total, floor = TINY_COSINE
    library = learning_rates(
        lambda o: get_cosine_with_min_lr_schedule_with_warmup(o, warmup, total, min_lr_rate=floor), total
    )
    reference = [cosine_reference(step, warmup, total, floor) for step in range(total)]
    assert library[warmup:] == reference[warmup:]
    assert library[:warmup] == [step / warmup for step in range(warmup)] != reference[:warmup]


def test_transformers_inverse_sqrt_is_ours_one_step_late():
    """Why training/optim.py keeps its own: the library counts steps from 0 (lr 0 at the first step), the paper
    from 1, so every rate of the library's is the paper's of the step before."""
    from transformers.optimization import get_inverse_sqrt_schedule

    library = learning_rates(lambda o: get_inverse_sqrt_schedule(o, TINY_INVERSE_SQRT), 2000)
    reference = [inverse_sqrt_reference(step, TINY_INVERSE_SQRT) for step in range(2000)]
    assert library[0] == 0.0
    assert library[1:] == pytest.approx(reference[:-1], rel=1e-12)
    assert all(a != b for a, b in zip(library, reference, strict=True))
