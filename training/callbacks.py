"""Callbacks: what the training loop does around each step, as transformers' `TrainerCallback` has it.

    class StopAtLoss(TrainerCallback):
        def on_log(self, trainer, record, **kwargs):
            if record.get("train_loss", 99) < 2.0:
                trainer.state.stop_reason = "loss_below_2"     # ends the run after this step; it then exports

    run(args, task, callbacks=[StopAtLoss()])                   # or Trainer(args, callbacks=[...])

A callback receives the `Trainer` (its `args`, `state`, `control`, `accelerator`, `model`, ...) and the event's
values as keywords; unknown keywords are for later events, so every hook takes `**kwargs`. At the end of each
optimizer step the trainer calls, in this order, each callback in its list:

    on_train_begin(trainer)                     after resuming (state.step is the step resumed from), before step 1
    on_step_end(trainer, result)                state.step counted; result: train_loss, grad_norm, targets, as
                                                tensors on the device (reading one waits for the device to finish
                                                the step: read them only when needed, as the built-in ones do at
                                                logging steps; state.tokens_seen is counted at those reads)
        -> if control.should_log: the step's record (loss, learning rate, throughput)
        -> if control.should_evaluate: trainer.evaluate(), the best evaluation noted in state, then
    on_evaluate(trainer, metrics, previous_best)    metrics: val_loss, val_perplexity
        -> the record, with the evaluation's metrics, goes to state.history, then
    on_log(trainer, record)                     one metrics.jsonl line
        -> if control.should_save (or SIGTERM / SIGINT arrived during the step): a checkpoint, then
    on_save(trainer, path)
    on_train_end(trainer)                       after the last step (not when a signal or an error ends the run)

To stop the run, set `trainer.state.stop_reason` (a short word: it is run.json's `training.stop_reason`): the
loop ends after the current step and the run exports, as early stopping does. To ask for a log line, an
evaluation or a checkpoint at this step, set `control.should_log`, `should_evaluate` or `should_save` in
`on_step_end` (`should_save` also in `on_evaluate` and `on_log`); they are cleared before the next step.
The built-in behaviours below are callbacks too, first in the list (`default_callbacks`); a user's come after
them, so theirs see what the built-in ones decided.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .checkpoints import read_metrics


@dataclass
class TrainerControl:
    """What the callbacks ask of the loop at this step (as transformers' `TrainerControl`); the `should_*`
    requests are cleared at the end of every step, `keep_step` stays."""

    should_log: bool = False
    should_evaluate: bool = False
    should_save: bool = False
    keep_step: int | None = None  # a checkpoint that the rotation (--keep-checkpoints) must not remove

    def new_step(self) -> None:
        self.should_log = self.should_evaluate = self.should_save = False


class TrainerCallback:
    """The events of a run; every hook does nothing unless overridden (see the module's docstring)."""

    def on_train_begin(self, trainer, **kwargs) -> None:
        pass

    def on_step_end(self, trainer, result: dict, **kwargs) -> None:
        pass

    def on_evaluate(self, trainer, metrics: dict, previous_best: float, **kwargs) -> None:
        pass

    def on_log(self, trainer, record: dict, **kwargs) -> None:
        pass

    def on_save(self, trainer, path: str, **kwargs) -> None:
        pass

    def on_train_end(self, trainer, **kwargs) -> None:
        pass


def last_step(trainer) -> bool:
    return trainer.state.step == trainer.args.max_steps


class LogMetrics(TrainerCallback):
    """A record every `log_every` steps and at the last: metrics.jsonl, the trackers (`--report-to`), the progress
    bar's postfix, and a line for each evaluation; the first step's loss as a line too."""

    def on_train_begin(self, trainer, **kwargs) -> None:
        args, accelerator, path = trainer.args, trainer.accelerator, trainer.metrics_path
        if accelerator.is_main_process and os.path.exists(path):
            # Keep what the checkpoint we continue from had logged; drop the rest (or all, on a fresh run).
            kept = [json.dumps(r) + "\n" for r in read_metrics(path) if r["step"] <= trainer.state.step]
            with open(path, "w") as f:
                f.writelines(kept)
        if args.report_to != "none":
            config = {k: v for k, v in args.to_dict().items() if isinstance(v, (int, float, str, bool))}
            # the trackers that write files write them into the run folder (under --overwrite its staging folder), not
            # the working directory
            local = {"dvclive": {"dir": os.path.join(args.work_dir, "dvclive"), "save_dvc_exp": False}}
            accelerator.init_trackers("deriv", config=config, init_kwargs=local)

    def on_step_end(self, trainer, result: dict, **kwargs) -> None:
        if trainer.state.step % trainer.args.log_every == 0 or last_step(trainer):
            trainer.control.should_log = True
        if trainer.state.step == 1:  # the first sign that training works, without waiting `log_every` steps
            loss = float(result["train_loss"])  # the one read of the device outside the logging steps
            trainer.print(f"step 1: training loss {loss:.4f}")
            trainer.bar.set_postfix(loss=f"{loss:.3f}")

    def on_evaluate(self, trainer, metrics: dict, **kwargs) -> None:
        trainer.print(
            f"step {trainer.state.step}: validation loss {metrics['val_loss']:.4f}, "
            f"perplexity {metrics['val_perplexity']:.2f}"
        )

    def on_log(self, trainer, record: dict, **kwargs) -> None:
        if trainer.accelerator.is_main_process:
            with open(trainer.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if trainer.args.report_to != "none":
            trainer.accelerator.log({k: v for k, v in record.items() if k != "step"}, step=trainer.state.step)
        if "train_loss" in record and not trainer.bars:  # no bar to show it on: a line (main process only)
            trainer.print(
                f"step {record['step']}: training loss {record['train_loss']:.4f}, lr {record['learning_rate']:.1e}, "
                f"{record['tokens_per_second']:.0f} tokens/s"
            )
        if "train_loss" in record:
            trainer.bar.set_postfix(
                loss=f"{record['train_loss']:.3f}",
                lr=f"{record['learning_rate']:.1e}",
                tok_s=f"{record['tokens_per_second']:.0f}",
            )

    def on_train_end(self, trainer, **kwargs) -> None:
        if trainer.args.report_to != "none":
            trainer.accelerator.end_training()


class EvaluateEvery(TrainerCallback):
    """An evaluation every `eval_every` steps and at the last step."""

    def on_step_end(self, trainer, result: dict, **kwargs) -> None:
        if trainer.state.step % trainer.args.eval_every == 0 or last_step(trainer):
            trainer.control.should_evaluate = True


class EarlyStopping(TrainerCallback):
    """Count the evaluations that did not lower the best loss by more than `early_stopping_threshold`; after
    `early_stopping_patience` of them in a row the run stops (and exports) at the end of this step. The count is
    `state.evals_without_improvement`, so a resumed run continues it."""

    def on_evaluate(self, trainer, metrics: dict, previous_best: float, **kwargs) -> None:
        state, args = trainer.state, trainer.args
        improved = metrics["val_loss"] < previous_best - args.early_stopping_threshold
        state.evals_without_improvement = 0 if improved else state.evals_without_improvement + 1
        patience = args.early_stopping_patience
        if patience and state.evals_without_improvement >= patience and state.step < args.max_steps:
            state.stop_reason = "early_stopping"
            trainer.print(
                f"early stopping at step {state.step}: {patience} evaluation(s) without a validation loss below "
                f"{state.best_val_loss:.4f} (step {state.best_step}) by more than {args.early_stopping_threshold}"
            )


class KeepBest(TrainerCallback):
    """`--export best`: the best evaluation's step is saved as a checkpoint and kept out of the rotation, so that
    the driver can load its weights back at the end (`Trainer.load_best`)."""

    def on_train_begin(self, trainer, **kwargs) -> None:
        if trainer.args.export == "best":
            trainer.control.keep_step = trainer.state.best_step  # a resumed run's best so far

    def on_evaluate(self, trainer, metrics: dict, **kwargs) -> None:
        state, control = trainer.state, trainer.control
        if trainer.args.export == "best" and state.best_step == state.step:
            control.should_save, control.keep_step = True, state.step


class CheckpointEvery(TrainerCallback):
    """A checkpoint every `save_every` steps (a stop signal saves one too; the trainer sees to that)."""

    def on_step_end(self, trainer, result: dict, **kwargs) -> None:
        if trainer.state.step % trainer.args.save_every == 0:
            trainer.control.should_save = True


def default_callbacks() -> list[TrainerCallback]:
    """The built-in behaviours, in the order they run: log before early stopping's message, keep-best after the
    best is known."""
    return [LogMetrics(), EvaluateEvery(), EarlyStopping(), KeepBest(), CheckpointEvery()]
