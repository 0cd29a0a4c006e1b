"""The task contract: what a task knows, so that the driver (`driver.run`) can do everything else once.

A task is one file: `lm.py` (causal language modelling), `translation.py` (the encoder-decoder) and `sft.py`
(chat fine-tuning). The driver calls, in order:

    task.open_init_from()                 with --init-from: its model, checked, before anything is read or written
    task.load()                           read the source and split it (before anything is trained on it)
    task.tokenizer_texts()                the training split's texts, for a new tokenizer
    task.datasets(tokenizer)              (train, validation) datasets, tokenized with `datasets.map`
    task.start_model(tokenizer)           a new model (`build_model`), or the --init-from folder's (opened above)
    task.collator, task.sampler(...)      how the loader makes batches
    task.count_targets(batch)             target tokens in a batch (what the loss averages over)
    task.compute_loss(model, batch, n)    the training loss
    task.generation_config(model, tok)    the exported folder's decoding defaults
    task.exported_model(model, weights)   what the folder holds (a wrapped model unwrapped: LoRA merged)
    task.final_metrics(model, tok)        scores beyond validation loss (BLEU for translation)
    task.record_data(), sample_texts()    what the run record says about the data
    task.show_samples(model, tok, say)    a few outputs at the end
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TaskData:
    """What a task's data becomes, once: everything the trainer's loaders need, in one declared value."""

    train: Any  # a datasets.Dataset (or a torch IterableDataset: a stream, which shuffles itself)
    validation: Any  # a datasets.Dataset, read in order, whole (or its first `eval_batches` batches)
    collator: Callable[[list[dict]], dict]  # examples -> a batch of tensors
    train_sampler: torch.utils.data.Sampler | None = None  # the training order; None: a seeded shuffle
    eval_batches: int | None = None  # validation batches per evaluation (None: the whole split)
    unit: str = "examples"  # what one example is, for messages: blocks, pairs, conversations
    token_kind: str = "tokens"  # what the loss counts, for messages: tokens, target tokens, assistant tokens


class Task:
    """The defaults suit a task whose model computes its own loss from `labels`."""

    name = "task"  # the run record's `task`
    model_class = None  # the PreTrainedModel an --init-from folder must hold
    pipeline_class = None  # a Pipeline the exported folder carries, for `pipeline(model=folder)`
    eval_batches: int | None = None  # validation batches per evaluation (None: the whole split)
    initial = None  # the --init-from model, once `open_init_from` has loaded it

    def __init__(self, args):
        self.args = args
        self.collator = None  # the loader's collate_fn; a task may set it once its model is built
        self.say = print  # the driver gives its accelerator's print (main process only)

    def load(self) -> None:
        raise NotImplementedError

    def tokenizer_texts(self) -> Iterable[str]:
        raise NotImplementedError

    def datasets(self, tokenizer) -> tuple:
        raise NotImplementedError

    def build_model(self, tokenizer) -> torch.nn.Module:
        """A new model of the shape the arguments give, its vocabulary the tokenizer's."""
        raise NotImplementedError

    def adopt(self, model, tokenizer) -> torch.nn.Module:
        """What the task sets up once its model exists (new or loaded), such as a collator that needs it."""
        return model

    def open_init_from(self) -> torch.nn.Module:
        """The --init-from folder's model: this task's model type, its weights read from safetensors only and
        complete (`load_weights`: a pickle is never opened, a missing or misshapen tensor is refused, not drawn
        at random). The driver calls it first, so a folder that cannot start the run stops it before the data
        is read or anything is written."""
        from ..folder.load import load_weights, read_folder

        folder = self.args.init_from
        expected = self.model_class.config_class.model_type
        found = read_folder(folder).config.get("model_type")  # config.json as written: no class chosen by it yet
        if found != expected:
            raise ValueError(f"--init-from {folder} holds a {found!r} model; this task trains {expected!r} models.")
        self.initial = load_weights(self.model_class, folder)  # Deriv's types are registered: no remote code
        return self.initial

    def start_model(self, tokenizer) -> torch.nn.Module:
        """The model training starts from: a new one, or the weights and architecture of --init-from."""
        folder = self.args.init_from
        if not folder:
            return self.adopt(self.build_model(tokenizer), tokenizer)
        model = self.initial if self.initial is not None else self.open_init_from()
        self.initial = None  # the run owns it now
        model.config.dropout = self.args.dropout  # the one model setting a run chooses (read at forward time)
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = self.args.dropout
        positions = model.config.max_position_embeddings
        if self.args.max_position_embeddings > positions:
            raise ValueError(
                f"--context-length {self.args.max_position_embeddings} is longer than the {positions} positions the model "
                f"in {folder} has; pass --context-length {positions} or less."
            )
        model = self.match_vocabulary(model, tokenizer)
        if len(tokenizer) > model.config.vocab_size:
            raise ValueError(f"{folder}'s tokenizer has {len(tokenizer)} ids, its model {model.config.vocab_size}.")
        return self.adopt(model, tokenizer)

    def match_vocabulary(self, model, tokenizer) -> torch.nn.Module:
        """An --init-from model for a tokenizer the task may have grown (`datasets` runs first); by default as is."""
        return model

    def sampler(self, dataset, seed: int):
        """The order of the training examples; None: a seeded shuffle (the loader's)."""
        return None

    def count_targets(self, batch: dict) -> torch.Tensor:
        return (batch["labels"] != -100).sum()

    def compute_loss(self, model, batch: dict, num_targets: torch.Tensor) -> torch.Tensor:
        """Sum of token losses / `num_targets` (the target tokens of the whole accumulation window)."""
        return model(**batch, num_items_in_batch=num_targets).loss

    def generation_config(self, model, tokenizer):
        raise NotImplementedError

    def exported_model(self, model, state_dict) -> tuple:
        """(model, state dict) the folder is written from; a task that wraps its model unwraps it here."""
        return model, state_dict

    def write_extras(self, folder: str) -> None:
        """Files beside the model in the folder being exported (a temporary one, renamed into place after)."""

    def record_procedure(self) -> dict:
        """Task-specific fields of the run record's `procedure`."""
        return {}

    def final_metrics(self, model, tokenizer) -> dict:
        return {}

    def record_data(self) -> dict:
        raise NotImplementedError

    def sample_texts(self) -> list[str]:
        """A few hundred training texts, to measure characters per token."""
        raise NotImplementedError

    def show_samples(self, model, tokenizer, say) -> None:
        pass
