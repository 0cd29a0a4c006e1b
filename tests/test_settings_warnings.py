"""Settings that cannot do what they say are named when the run starts (a `note:` line each, with the fix);
the run's own lines are never glued onto the progress bar, and the first loss shows at step 1."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
from tqdm import tqdm

from deriv_lm.training.args import (
    CHAT_PRESETS,
    PRESETS,
    TRANSLATION_PRESETS,
    ChatTrainingArguments,
    TrainingArguments,
    TranslationTrainingArguments,
    build_parser,
)
from deriv_lm.training.callbacks import LogMetrics
from deriv_lm.training.trainer import Trainer


def notes(**values) -> list[str]:
    values.setdefault("save_every", 1)  # a checkpoint every step: each test names the one setting it is about
    return TrainingArguments(**values).notes()


@pytest.mark.parametrize(
    "kind, presets",
    [
        (TrainingArguments, PRESETS),
        (TranslationTrainingArguments, TRANSLATION_PRESETS),
        (ChatTrainingArguments, CHAT_PRESETS),
    ],
)
def test_the_presets_make_no_notes(kind, presets):
    for name, values in presets.items():
        assert kind(**values).notes() == [], name


def test_warmup_as_long_as_the_run_is_named_with_a_warmup_that_fits():
    (note,) = notes(max_steps=20, warmup_steps=60)
    assert "--warmup-steps 60" in note and "--max-steps 20" in note and "never reaches its peak" in note
    assert "--warmup-steps 2 " in note
    assert notes(max_steps=20, warmup_steps=19) == []


def test_a_log_interval_longer_than_the_run_is_named_and_a_save_interval_is_not():
    (log,) = notes(max_steps=5, warmup_steps=1, log_every=10, save_every=50)
    assert log.startswith("--log-every 10 is longer than --max-steps 5") and "last step only" in log


def test_early_stopping_that_cannot_trigger_is_named():
    (note,) = notes(max_steps=100, warmup_steps=10, eval_every=40, early_stopping_patience=2)
    assert "--early-stopping-patience 2" in note and "the 2 that --eval-every 40 gives" in note
    assert notes(max_steps=100, warmup_steps=10, eval_every=10, early_stopping_patience=2) == []


def test_export_best_with_one_evaluation_is_named():
    (note,) = notes(max_steps=100, warmup_steps=10, eval_every=100, export="best")
    assert note.startswith("--export best") and "the best weights are the last" in note


def test_the_paper_schedule_without_warmup_is_refused():
    with pytest.raises(ValueError, match="`warmup_steps` must be at least 1 with `lr_schedule` inverse_sqrt"):
        TranslationTrainingArguments(lr_schedule="inverse_sqrt", warmup_steps=0)


def test_the_trainer_prints_each_note_once_as_it_starts(tmp_path, capsys):
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=20, warmup_steps=60)
    Trainer(args, cpu=True)
    out = capsys.readouterr().out
    assert out.count("note: --warmup-steps 60 is not shorter than --max-steps 20") == 1


def test_no_progress_help_says_what_the_flag_does():
    help_text = " ".join(build_parser(TrainingArguments).format_help().split())
    assert "--no-progress, --no_progress progress bars while the data is prepared and the model trains" in help_text
    assert "show progress bars" not in help_text


def quiet_trainer() -> Trainer:
    trainer = Trainer.__new__(Trainer)  # no accelerator, run lock or seeds: only what printing needs
    trainer.accelerator = SimpleNamespace(print=print)
    return trainer


def test_a_log_line_starts_a_line_of_its_own_while_the_bar_shows(capsys):
    trainer = quiet_trainer()
    trainer.bar = tqdm(total=3, file=sys.stdout, desc="training", mininterval=0)  # bar and log: one terminal
    trainer.bar.update(1)
    trainer.print("step 1: validation loss 7.0000, perplexity 1096.63")
    trainer.bar.close()
    out = capsys.readouterr().out
    before = out[: out.index("step 1: validation loss")]
    assert before.endswith(("\r", "\n")), repr(before[-40:])  # the bar was cleared first, not written after


def test_the_first_loss_shows_at_step_one(capsys):
    trainer = quiet_trainer()
    trainer.bar = tqdm(total=10, disable=True)
    trainer.args = SimpleNamespace(log_every=10, max_steps=100)
    trainer.control = SimpleNamespace(should_log=False)
    trainer.state = SimpleNamespace(step=1)
    LogMetrics().on_step_end(trainer, result={"train_loss": 8.3177})
    assert capsys.readouterr().out == "step 1: training loss 8.3177\n"
    trainer.state.step = 2
    LogMetrics().on_step_end(trainer, result={"train_loss": 8.1})
    assert capsys.readouterr().out == ""
