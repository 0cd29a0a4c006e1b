"""The task contract: a task is its data and its loss; the driver (`driver.run`) does everything else once.

A task is one file: `lm.py` (causal language modelling), `translation.py` (the encoder-decoder) and `sft.py`
(chat fine-tuning); a test defines another in its own file (`tests/test_new_task.py`). State flows between the
hooks as the values they return, never as attributes one hook sets for a later one. The driver calls, in order:

    initial = task.open_init_from()           with --init-from only: its model, checked before anything is read
                                              or written (a folder that cannot start the run stops it here)
    source = task.read()                      read the data and split it, once: a `Source` (the training texts
                                              for a new tokenizer, a sample for characters per token, the splits)
    data = task.prepare(source, tokenizer)    a `TaskData`: tokenized sets, collator, training order, units, and
                                              the run record's `data` section
    model = task.build_model(tokenizer)       a new model of the arguments' shape
         or task.from_folder(initial, tok)    the --init-from model, fitted to this run (dropout, tokenizer)
    model, data = task.start(model, tok, source, data)
                                              what needs the model: a collator that shifts with it, adapters,
                                              a score of the model before training (kept in `data.before`)
    task.count_targets(batch)                 target tokens in a batch (what the loss averages over)
    task.compute_loss(model, batch, n)        the training loss
    outcome = task.finish(model, state_dict, tokenizer, source, data, metrics)
                                              an `Outcome`: what the folder holds (a wrapped model unwrapped,
                                              LoRA merged or its adapter beside), the task's metrics and
                                              run-record fields, its card text, its sample lines, its summary
    task.generation_config(model, tokenizer)  the exported folder's decoding defaults (through `ready`)
    outcome = task.score_exported(outcome, tokenizer, source, data, metrics)
                                              once the folder is exported: the scores that take long (test
                                              BLEU by beam search), so a run stopped while scoring keeps its
                                              model; their Outcome is added to run.json and the card

Eleven hooks; only `read`, `prepare`, `build_model` and `generation_config` have no default. Three class attributes
say what the task is: `name` (the run record's `task`), `model_class` (what an --init-from folder must hold) and
`pipeline_class` (a Pipeline the folder carries, or None).

The driver, the exported folder (`export.py`) and the card (`hub_card`) know no task by name: a task's own
numbers go to run.json's `procedure.task` and `metrics.task`, its card text to run.json's `card` (markdown it
renders from its own values at export), which the card inserts as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import UsageError


@dataclass
class Source:
    """What `read` found, read and split once, before anything is trained on it."""

    splits: Any  # the task's own reading (documents, pairs, conversations by split), for `prepare` and `finish`
    tokenizer_texts: Callable[[], Iterable[str]]  # the training split's texts, for a new tokenizer (read lazily)
    sample_texts: Callable[[], list[str]]  # a few hundred training texts, to measure characters per token
    description: str = ""  # what was read, in words (no absolute paths)


@dataclass
class TaskData:
    """What a task's data becomes, once: everything the trainer's loaders need, in one declared value."""

    train: Any  # a datasets.Dataset (or a torch IterableDataset: a stream, which shuffles itself)
    validation: Any  # a datasets.Dataset, read in order, whole (or its first `eval_batches` batches)
    collator: Callable[[list[dict]], dict] | None  # examples -> a batch of tensors (None until `start`, at most)
    train_sampler: torch.utils.data.Sampler | None = None  # the training order; None: a seeded shuffle
    eval_batches: int | None = None  # validation batches per evaluation (None: the whole split)
    unit: str = "examples"  # what one example is, for messages: blocks, pairs, conversations
    token_kind: str = "tokens"  # what the loss counts, for messages: tokens, target tokens, assistant tokens
    record: dict = field(default_factory=dict)  # the run record's `data` section (`folder.record.DataRecord`)
    before: dict = field(default_factory=dict)  # what `start` measured of the model before training, for `finish`


@dataclass
class Outcome:
    """What a task ends with (`finish`): the folder's model and everything the task says about its run."""

    model: torch.nn.Module  # the model the folder holds (unwrapped, merged), in eval mode with its defaults
    state_dict: dict | None  # its gathered weights, or None: the model's own
    metrics: dict = field(default_factory=dict)  # run.json `metrics.task`: scores beyond validation loss
    procedure: dict = field(default_factory=dict)  # run.json `procedure.task`: the task's own hyperparameters
    card: dict = field(default_factory=dict)  # run.json `card` (`folder.record.CardRecord`): the task's card text
    samples: list[str] = field(default_factory=list)  # lines shown at the end of the run
    summary: str = ""  # what the run's last line adds after the validation perplexity
    write_files: Callable[[str], None] | None = None  # files beside the model in the folder (a LoRA adapter)


class Task:
    """The defaults suit a task whose model computes its own loss from `labels`."""

    name = "task"  # the run record's `task`
    model_class = None  # the PreTrainedModel an --init-from folder must hold
    pipeline_class = None  # a Pipeline the exported folder carries, for `pipeline(model=folder)`

    def __init__(self, args):
        self.args = args
        self.say = print  # the driver gives its accelerator's print (main process only)

    def open_init_from(self) -> torch.nn.Module:
        """The --init-from folder's model: this task's model type, its weights read from safetensors only and
        complete (`load_weights`: a pickle is never opened, a missing or misshapen tensor is refused, not drawn
        at random), and a tokenizer that is code of the folder's own refused (`folder/remote_code.py`). The driver
        calls it first, so a folder that cannot start the run stops it before the data is read or anything is
        written."""
        from ..folder.load import load_weights, read_folder
        from ..folder.remote_code import check_tokenizer_code

        folder = self.args.init_from
        expected = self.model_class.config_class.model_type
        found = read_folder(folder).config.get("model_type")  # config.json as written: no class chosen by it yet
        if found != expected:
            raise UsageError(f"--init-from {folder} holds a {found!r} model; this task trains {expected!r} models.")
        check_tokenizer_code(folder, consent=None)  # its tokenizer loads next: no code of the folder's runs there
        return load_weights(self.model_class, folder)  # Deriv's types are registered: no remote code

    def read(self) -> Source:
        raise NotImplementedError

    def prepare(self, source: Source, tokenizer) -> TaskData:
        raise NotImplementedError

    def build_model(self, tokenizer) -> torch.nn.Module:
        """A new model of the shape the arguments give, its vocabulary the tokenizer's."""
        raise NotImplementedError

    def from_folder(self, model, tokenizer) -> torch.nn.Module:
        """The --init-from model (`open_init_from`'s) for this run: its dropout the run's, its positions and
        vocabulary checked against the run's context and tokenizer. A task whose `prepare` grew the tokenizer
        grows the model's embeddings first (`sft.py`)."""
        folder, positions = self.args.init_from, model.config.max_position_embeddings
        model.config.dropout = self.args.dropout  # the one model setting a run chooses (read at forward time)
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = self.args.dropout
        if self.args.max_position_embeddings > positions:
            raise UsageError(
                f"--context-length {self.args.max_position_embeddings} is longer than the {positions} positions the "
                f"model in {folder} has; pass --context-length {positions} or less."
            )
        if len(tokenizer) > model.config.vocab_size:
            raise UsageError(f"{folder}'s tokenizer has {len(tokenizer)} ids, its model {model.config.vocab_size}.")
        return model

    def start(self, model, tokenizer, source: Source, data: TaskData) -> tuple[torch.nn.Module, TaskData]:
        """What the task sets up once its model exists (new or loaded): by default nothing."""
        return model, data

    def count_targets(self, batch: dict) -> torch.Tensor:
        return (batch["labels"] != -100).sum()

    def compute_loss(self, model, batch: dict, num_targets: torch.Tensor) -> torch.Tensor:
        """Sum of token losses / `num_targets` (the target tokens of the whole accumulation window)."""
        return model(**batch, num_items_in_batch=num_targets).loss

    def generation_config(self, model, tokenizer):
        raise NotImplementedError

    def finish(self, model, state_dict, tokenizer, source: Source, data: TaskData, metrics: dict) -> Outcome:
        """The end of the run, on the main process: `model` as trained (train mode), `metrics` the exported
        weights' validation loss and perplexity. By default the model as it is, and nothing more to say."""
        return Outcome(self.ready(model, tokenizer), state_dict)

    def score_exported(self, outcome: Outcome, tokenizer, source: Source, data: TaskData, metrics: dict):
        """After the folder is exported: `outcome` with the scores that take long added (its metrics, card text,
        samples and summary), which the driver adds to run.json and the card; None when there are none (the
        default)."""
        return None

    def ready(self, model, tokenizer) -> torch.nn.Module:
        """`model` as the folder holds it: in eval mode, without training-only settings, with its decoding
        defaults. Not a hook: `finish` calls it once the model is the exported one (and before scoring it)."""
        model.eval()
        if self.args.gradient_checkpointing:
            model.activation_checkpointing_disable()  # a training setting, not the exported model's
        model.generation_config = self.generation_config(model, tokenizer)
        return model
