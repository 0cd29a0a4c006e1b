"""Training on `accelerate` and `datasets`: one driver (`driver.run`) and the tasks on it (`lm`, `translation`, `sft`).

from deriv_lm.training import TrainingArguments, train_lm
train_lm(TrainingArguments(max_steps=100))          # the `tiny` preset on the embedded default corpus
"""

from .args import PRESETS, TRANSLATION_PRESETS, TrainingArguments, TranslationTrainingArguments
from .callbacks import TrainerCallback, TrainerControl
from .driver import run
from .lm import LanguageModelTask, train_lm
from .stops import NonFiniteLoss, TrainingInterrupted
from .task import Outcome, Source, Task, TaskData
from .trainer import Trainer
from .translation import TranslationTask, train_translation


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
