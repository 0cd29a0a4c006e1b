"""Training on `accelerate` and `datasets`: one trainer core (`trainer.py`) and the tasks on it (`lm.py`).

from deriv_lm.training import TrainingArguments, train_lm
train_lm(TrainingArguments(max_steps=100))          # the `tiny` preset on the embedded default corpus
"""

from .args import PRESETS, TrainingArguments
from .lm import train_lm
from .trainer import NonFiniteLoss, Trainer, TrainingInterrupted


__all__ = ["PRESETS", "NonFiniteLoss", "Trainer", "TrainingArguments", "TrainingInterrupted", "train_lm"]
