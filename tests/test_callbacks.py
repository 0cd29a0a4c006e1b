"""The trainer's callbacks (training/callbacks.py): the events a callback sees, in order and at their steps, what
it may ask of the loop (stop, evaluate, save), and the built-in behaviours that are callbacks themselves.
Every run is a tiny language model on CPU, a few steps long."""

import json
import os

import pytest

from deriv_lm.training import LanguageModelTask, TrainingArguments, run
from deriv_lm.training.callbacks import KeepBest, TrainerCallback, TrainerControl, default_callbacks
from deriv_lm.training.checkpoints import TrainerState


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    with open(path, "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"line {i}: {i % 13} times {i % 7} is {(i % 13) * (i % 7)}"}) + "\n")
    return path


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory, corpus_file):
    """One run trains the tokenizer; the others reuse it (and skip that work)."""
    args = tiny_args(tmp_path_factory.mktemp("first"), corpus_file, max_steps=1)
    run(args, LanguageModelTask(args), cpu=True)
    return os.path.join(args.output_dir, "tokenizer")


def tiny_args(tmp_path, corpus_file, **overrides) -> TrainingArguments:
    values = dict(
        output_dir=str(tmp_path / "run"),
        files=[str(corpus_file)],
        cache_dir=str(tmp_path / "cache"),
        vocab_size=300,
        max_position_embeddings=16,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        batch_size=4,
        max_steps=4,
        warmup_steps=1,
        log_every=2,
        eval_every=2,
        eval_batches=1,
        save_every=4,
        keep_checkpoints=10,
        samples=0,
        progress=False,
        num_proc=1,
    )
    values.update(overrides)
    return TrainingArguments(**values)


class Recorder(TrainerCallback):
    """Notes every event with the step the state is at when it arrives."""

    def __init__(self):
        self.events, self.order = [], None

    def on_train_begin(self, trainer, **kwargs):
        self.events.append(("train_begin", trainer.state.step))
        self.order = [type(callback).__name__ for callback in trainer.callbacks]

    def on_step_end(self, trainer, result, **kwargs):
        assert set(result) == {"train_loss", "grad_norm", "targets"}
        self.events.append(("step_end", trainer.state.step))

    def on_evaluate(self, trainer, metrics, previous_best, **kwargs):
        self.events.append(("evaluate", trainer.state.step))

    def on_log(self, trainer, record, **kwargs):
        assert record["step"] == trainer.state.step
        self.events.append(("log", trainer.state.step))

    def on_save(self, trainer, path, **kwargs):
        assert os.path.basename(path) == f"step-{trainer.state.step:07d}" and os.path.isdir(path)
        self.events.append(("save", trainer.state.step))

    def on_train_end(self, trainer, **kwargs):
        self.events.append(("train_end", trainer.state.step))


def train(args, *callbacks) -> dict:
    run(args, LanguageModelTask(args), cpu=True, callbacks=list(callbacks))
    with open(os.path.join(args.output_dir, "run.json")) as f:
        return json.load(f)


def metrics(args) -> list[dict]:
    with open(os.path.join(args.output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def checkpoints(args) -> list[str]:
    return sorted(os.listdir(os.path.join(args.output_dir, "checkpoints")))


def test_a_callback_sees_the_events_in_order_at_their_steps(tmp_path, corpus_file, tokenizer_folder):
    recorder = Recorder()
    train(tiny_args(tmp_path, corpus_file, tokenizer=tokenizer_folder), recorder)
    assert recorder.events == [
        ("train_begin", 0),
        ("step_end", 1),
        ("step_end", 2),
        ("evaluate", 2),
        ("log", 2),
        ("step_end", 3),
        ("step_end", 4),
        ("evaluate", 4),
        ("log", 4),
        ("save", 4),
        ("train_end", 4),
    ]
    # the built-in ones first, the user's after them
    assert recorder.order == [type(c).__name__ for c in default_callbacks()] + ["Recorder"]


def test_the_built_in_callbacks_log_evaluate_and_save_on_their_schedule(tmp_path, corpus_file, tokenizer_folder):
    args = tiny_args(tmp_path, corpus_file, tokenizer=tokenizer_folder, max_steps=5, eval_every=3, save_every=2)
    record = train(args)
    lines = metrics(args)
    assert [line["step"] for line in lines] == [2, 3, 4, 5]  # every 2nd step, every 3rd, and the last
    assert ["train_loss" in line for line in lines] == [True, False, True, True]
    assert ["val_loss" in line for line in lines] == [False, True, False, True]
    assert checkpoints(args) == ["step-0000002", "step-0000004"]  # every 2nd step; the last is not one of them
    assert record["training"]["steps"] == 5 and record["training"]["stop_reason"] == "max_steps"


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer, result, **kwargs):
        if trainer.state.step == self.step:
            trainer.state.stop_reason = "enough"


def test_a_callback_stops_the_run_and_it_exports_as_early_stopping_does(tmp_path, corpus_file, tokenizer_folder):
    args = tiny_args(tmp_path, corpus_file, tokenizer=tokenizer_folder, max_steps=8, eval_every=3)
    recorder = Recorder()
    record = train(args, StopAt(5), recorder)
    assert record["training"]["steps"] == 5 and record["training"]["stop_reason"] == "enough"
    assert record["training"]["exported_step"] == 5
    assert recorder.events[-1] == ("train_end", 5) and ("step_end", 6) not in recorder.events
    assert os.path.exists(os.path.join(args.output_dir, "model.safetensors"))


class AskAtFirstStep(TrainerCallback):
    def on_step_end(self, trainer, result, **kwargs):
        if trainer.state.step == 1:
            trainer.control.should_evaluate = trainer.control.should_save = True


def test_a_callback_asks_for_an_evaluation_and_a_checkpoint(tmp_path, corpus_file, tokenizer_folder):
    args = tiny_args(tmp_path, corpus_file, tokenizer=tokenizer_folder)
    train(args, AskAtFirstStep())
    first = metrics(args)[0]
    assert first["step"] == 1 and "val_loss" in first and "train_loss" not in first  # evaluated, not a log step
    assert checkpoints(args) == ["step-0000001", "step-0000004"]
    assert [line["step"] for line in metrics(args)] == [1, 2, 4]  # the requests were for step 1 alone


def test_keep_best_protects_a_resumed_runs_best_checkpoint():
    class Resumed:
        args = TrainingArguments(export="best")
        state = TrainerState(step=8, best_step=6, best_val_loss=3.0)
        control = TrainerControl()

    KeepBest().on_train_begin(Resumed)
    assert Resumed.control.keep_step == 6  # before any new evaluation: the rotation must not remove step 6
    KeepBest().on_evaluate(Resumed, {"val_loss": 3.5})
    assert not Resumed.control.should_save  # not a new best: no extra checkpoint
