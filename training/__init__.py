"""Training on `accelerate` and `datasets`: one driver (`driver.run`) and the tasks on it (`lm`, `translation`, `sft`).

from deriv_lm.training import TrainingArguments, train_lm
train_lm(TrainingArguments(max_steps=100))          # the `tiny` preset on the embedded default corpus
"""

import importlib


_WHERE = {
    "PRESETS": "args",
    "TRANSLATION_PRESETS": "args",
    "TrainingArguments": "args",
    "TranslationTrainingArguments": "args",
    "TrainerCallback": "callbacks",
    "TrainerControl": "callbacks",
    "run": "driver",
    "LanguageModelTask": "lm",
    "train_lm": "lm",
    "NonFiniteLoss": "stops",
    "TrainingInterrupted": "stops",
    "Outcome": "task",
    "Source": "task",
    "Task": "task",
    "TaskData": "task",
    "Trainer": "trainer",
    "TranslationTask": "translation",
    "train_translation": "translation",
}

__all__ = [
    "PRESETS",
    "TRANSLATION_PRESETS",
    "LanguageModelTask",
    "NonFiniteLoss",
    "Outcome",
    "Source",
    "Task",
    "TaskData",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainingArguments",
    "TrainingInterrupted",
    "TranslationTask",
    "TranslationTrainingArguments",
    "run",
    "train_lm",
    "train_translation",
]


def __getattr__(name: str):
    """The names above, each imported from its module when first asked for: `deriv COMMAND` imports this package
    to parse its arguments, which must not wait for torch (see deriv_lm/__init__.py)."""
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
