"""The training loop on `accelerate`: one loop for every task, from a laptop CPU to many GPUs.

    accelerator = Accelerator(...)                     # DDP / FSDP / DeepSpeed come from `accelerate launch`
    model, optimizer, loaders = accelerator.prepare(...)
    resume from the newest complete checkpoint, or start afresh
    for each optimizer step:
        for each micro-batch of the accumulation window:
            loss = sum of token losses / target tokens in the whole window, all processes   (exact average)
            backward
        clip gradients; step; schedule
        the callbacks: log; evaluate; stop early; keep the best; checkpoint (and stop, if SIGTERM or SIGINT
        arrived during the step)

The task (`task.py`) supplies the collator, the sampler, how to count target tokens and the loss; the callbacks
(`callbacks.py`, transformers' `TrainerCallback` protocol) what happens around each step, the built-in ones and
a user's.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import sys
import time
from contextlib import nullcontext

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import DistributedType, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ..errors import MissingFile, UsageError
from .callbacks import EarlyStopping, TrainerCallback, TrainerControl, default_callbacks
from .checkpoints import Checkpoints, TrainerState
from .distributed import one_module_per_tied_embedding, settle_distributed_mode
from .optim import check_optimizer, choose_mixed_precision, inverse_sqrt, optimizer_and_schedule, warmup_cosine
from .runlock import acquire_run_lock
from .stops import STOP, NonFiniteLoss, TrainingInterrupted, deferred_stop, handle_stop_signals


__all__ = [
    "NonFiniteLoss",
    "Trainer",
    "TrainerCallback",
    "TrainerState",
    "TrainingInterrupted",
    "handle_stop_signals",
    "inverse_sqrt",
    "warmup_cosine",
]


class Trainer:
    """Create it first (it owns the Accelerator, takes the run lock and seeds every RNG), then `train`.
    `callbacks` run after the built-in ones (`callbacks.default_callbacks`), in the order given."""

    def __init__(self, args, cpu: bool = False, callbacks: list[TrainerCallback] | None = None):
        self.args = args
        self.callbacks = default_callbacks() + list(callbacks or [])
        self.control = TrainerControl()
        self.resumed_at: int | None = None  # the step a --resume continued from
        if args.compile:
            check_compiler()
        self.accelerator = Accelerator(
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            mixed_precision=choose_mixed_precision(args.mixed_precision, cpu),
            log_with=None if args.report_to == "none" else args.report_to,
            project_dir=args.work_dir,
            # seedable sampler: the shuffled order is a function of (seed, epoch), so resume can replay it
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
            cpu=cpu,
        )
        settle_distributed_mode(self.accelerator)  # FSDP on CPU processes; a DeepSpeed run that did not get it
        check_optimizer(args, self.accelerator)  # Muon needs whole matrices: not FSDP, DeepSpeed or LoRA
        if self.accelerator.is_main_process:  # before any work: a second run into the folder stops here
            acquire_run_lock(args.output_dir, say=self.accelerator.print)
        for note in args.notes():  # settings that cannot do what they say: allowed, never silent
            self.accelerator.print(f"note: {note}")
        # Progress bars on a terminal only: piped into a log, a bar is a line of carriage returns, so there the run
        # says where it is with a line per log record instead (LogMetrics.on_log).
        self.bars = args.progress and self.accelerator.is_main_process and sys.stderr.isatty()
        set_seed(args.seed)
        self.state = TrainerState()
        settings = f"--preset {args.preset} and these flags" if getattr(args, "preset", None) else "these settings"
        self.checkpoints = Checkpoints(self.accelerator, args.checkpoint_dir, args.keep_checkpoints, settings)
        self.metrics_path = os.path.join(args.work_dir, "metrics.jsonl")
        self.staged = args.work_dir != args.output_dir  # --overwrite: the run is built beside the old one
        self.unread: list[dict] = []  # the device values of the steps since the last `_read`
        self.last_read: dict = {}
        STOP.phase = "while preparing the data"

    # ---- setting up ------------------------------------------------------------------------------

    def _loader(self, dataset, train: bool) -> DataLoader:
        """Shuffled (or the task's length-grouped order) for training; in order, all of it, for evaluation."""
        sampler = self.data.train_sampler if train else None
        stream = isinstance(dataset, torch.utils.data.IterableDataset)  # it shuffles itself, if at all
        return DataLoader(
            dataset,
            batch_size=self.args.batch_size,
            shuffle=train and sampler is None and not stream,
            sampler=sampler,
            collate_fn=self.data.collator,
            generator=torch.Generator().manual_seed(self.args.seed),
            drop_last=train,
        )

    def _prepare(self, model, train_dataset, eval_dataset) -> None:
        if self.args.gradient_checkpointing:
            if not model.supports_gradient_checkpointing:
                raise UsageError(
                    f"--gradient-checkpointing: {type(model).__name__} does not support activation checkpointing"
                )
            # non-reentrant: the checkpointed forward may take keyword arguments and works under torch.compile
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if self.accelerator.distributed_type == DistributedType.FSDP:
            one_module_per_tied_embedding(model)
        optimizer, self.scheduler = optimizer_and_schedule(model, self.args)
        # The schedule counts optimizer steps; prepare() would step it once per process, so it stays unprepared.
        self.model, self.optimizer, self.train_dl, self.eval_dl = self.accelerator.prepare(
            model, optimizer, self._loader(train_dataset, train=True), self._loader(eval_dataset, train=False)
        )
        if self.args.compile:
            # subtle: compiled here, after prepare's DDP / FSDP wrapping, and not through accelerate's dynamo
            # plugin, which one process's first Accelerator fixes for every later one. The checkpoints
            # (save_state) still hold the plain prepared model, so their weight names are its own.
            self.model = torch.compile(self.model)
        window = self.args.gradient_accumulation_steps
        self.streaming = isinstance(train_dataset, torch.utils.data.IterableDataset)
        if self.streaming:
            return  # a stream has no length: passes end when it does (`_stream_windows`)
        if len(self.train_dl) < window:
            raise UsageError(
                f"The training split gives {len(self.train_dl)} batch(es) per process, fewer than one accumulation "
                f"window of {window}; use a smaller --batch-size or a larger corpus."
            )
        self.steps_per_epoch = len(self.train_dl) // window

    def _resume_or_start(self) -> None:
        args, accelerator = self.args, self.accelerator
        usable = self.checkpoints.newest_usable() if args.resume else None
        if usable:
            self.checkpoints.load(usable, self.state, self.scheduler)
            self.resumed_at = self.state.step
            accelerator.print(f"resumed from {usable} at step {self.state.step}")
        elif args.resume:
            accelerator.print(f"--resume: no checkpoint in {args.checkpoint_dir}; starting from step 0")
        else:
            self.checkpoints.remove_all()
        accelerator.wait_for_everyone()
        os.makedirs(args.work_dir, exist_ok=True)

    # ---- the loop --------------------------------------------------------------------------------

    def train(self, model, task, data) -> TrainerState:
        """Train `model` on `data` (the task's `TaskData`) with the task's loss until `max_steps`; the trained
        (wrapped) model is `self.model`."""
        self.task, self.data = task, data
        self._prepare(model, data.train, data.validation)
        self._resume_or_start()
        self._call("on_train_begin")
        self.bar = tqdm(
            total=self.args.max_steps,
            initial=self.state.step,
            desc="training",
            unit="step",
            disable=not self.bars,
            dynamic_ncols=True,
        )
        self.model.train()
        self._reset_clock()
        with deferred_stop():
            while not self._done():
                for window in self._windows():
                    self._after_step(self._step(window))
            self._read()  # the last steps' tokens and loss check, if no callback asked for them
        self.bar.close()
        STOP.phase = (
            f"while exporting (--overwrite: {self.args.output_dir} holds the earlier run as it was, or this one whole)"
            if self.staged
            else "while exporting (the output folder is as it was; continue with --resume)"
        )
        self._call("on_train_end")
        return self.state

    def _call(self, event: str, **values) -> None:
        """Every callback's `event` hook, in order (a callback without that hook is skipped)."""
        for callback in self.callbacks:
            hook = getattr(callback, event, None)
            if hook is not None:
                hook(self, **values)

    def _done(self) -> bool:
        return self.state.step >= self.args.max_steps or self.state.stop_reason is not None

    def _windows(self):
        """The rest of the current epoch, one accumulation window (a list of micro-batches) at a time.

        subtle: on resume the loader replays the epoch's shuffled order and skips what was already seen."""
        if self.streaming:
            yield from self._stream_windows()
            return
        window = self.args.gradient_accumulation_steps
        epoch, step_in_epoch = divmod(self.state.step, self.steps_per_epoch)
        self.train_dl.set_epoch(epoch)
        loader = self.train_dl
        if step_in_epoch:
            loader = self.accelerator.skip_first_batches(self.train_dl, step_in_epoch * window)
        batches = iter(loader)
        for _ in range(step_in_epoch, self.steps_per_epoch):
            if self._done():
                return
            start = time.perf_counter()
            micro_batches = [next(batches) for _ in range(window)]
            self.data_wait += time.perf_counter() - start
            yield micro_batches

    def _stream_windows(self):
        """The rest of the current pass over a stream, a window at a time; when the stream ends (a partial window
        is dropped), the next pass begins at the next call, `set_epoch` reordering its shuffle buffer by
        (seed, epoch). The position is (`state.epoch`, steps since `state.epoch_start_step`), JSON in every
        checkpoint: on resume the pass is read again from its start and the batches already trained on skipped,
        so the run sees the batches an uninterrupted one would.

        subtle: reading the stream runs under `fork_rng`. The loader draws a seed from the global generator each
        time it starts a pass; a resumed run starts one at its resume step where the uninterrupted run did not,
        and that draw would shift every dropout mask after it."""
        window, state = self.args.gradient_accumulation_steps, self.state
        self.train_dl.set_epoch(state.epoch)
        batches = iter(self.train_dl)
        # subtle: read and dropped here, not through accelerate's skip_first_batches, whose new loader restarts
        # the stream at pass 0 in older accelerate releases (1.2: the resumed run saw another order)
        for _ in range(state.step - state.epoch_start_step):
            next_window(batches, window)
        while not self._done():
            start = time.perf_counter()
            micro_batches = next_window(batches, window)
            self.data_wait += time.perf_counter() - start
            if len(micro_batches) < window:
                break
            yield micro_batches
        else:
            return
        passed = state.step - state.epoch_start_step
        if passed == 0:
            raise UsageError(
                f"The training stream gives fewer than {window * self.args.batch_size} block(s) of "
                f"{self.args.max_position_embeddings} tokens per process, one accumulation window; use a longer "
                "stream, a smaller --batch-size or a shorter --context-length."
            )
        state.epoch, state.epoch_start_step = state.epoch + 1, state.step
        self.print(f"pass {state.epoch} over the stream ended after {passed} step(s); another begins")

    def _step(self, micro_batches: list[dict]) -> dict:
        """One optimizer step over a window: the loss is averaged over every target token of the window on
        every process, an exact mean whatever the accumulation, the number of processes and the padding."""
        accelerator, model, start = self.accelerator, self.model, time.perf_counter()
        local = sum(self.task.count_targets(b) for b in micro_batches)
        targets = accelerator.reduce(local.detach().clone(), "sum")
        deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
        loss_sum = torch.zeros((), device=accelerator.device)
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            # As transformers' Trainer does: the window is fetched ahead (to count its tokens), so tell
            # accelerate which micro-batch ends it instead of letting it guess from the loader.
            accelerator.gradient_state._set_sync_gradients(last)
            with accelerator.no_sync(model) if not last and not deepspeed else nullcontext():
                loss = self.task.compute_loss(model, batch, targets)
                loss_sum += loss.detach().float()
                # backward divides by the window and DDP averages over processes: undo both.
                accelerator.backward(loss * len(micro_batches) * accelerator.num_processes)
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.compute += time.perf_counter() - start
        # subtle: the values stay on the device, unread. Reading one (`.item()`) waits until the device has finished
        # the step, and the next step's work could not be queued meanwhile; `_read` reads every unread step's values
        # at once, at the steps that log, evaluate or save.
        return {"train_loss": accelerator.reduce(loss_sum, "sum"), "grad_norm": grad_norm, "targets": targets}

    def _read(self) -> dict:
        """The values of the steps since the last read, on the host in one wait for the device: their target tokens
        counted into the state, a loss that is not a number stopping the run (naming the first step it appeared at,
        before any checkpoint or evaluation of what followed); returns the last step's values as numbers."""
        if not self.unread:
            return self.last_read
        start, first = time.perf_counter(), self.state.step - len(self.unread) + 1
        losses = torch.stack([r["train_loss"].float() for r in self.unread]).tolist()
        targets = torch.stack([r["targets"] for r in self.unread]).tolist()
        grad_norm = self.unread[-1]["grad_norm"]
        self.last_read = {"train_loss": losses[-1], "grad_norm": None if grad_norm is None else float(grad_norm)}
        self.compute += time.perf_counter() - start  # the wait is the device finishing those steps' work
        self.unread = []
        for step, loss in enumerate(losses, start=first):
            if not math.isfinite(loss):
                last_good = (self.checkpoints.found() or ["none"])[-1]
                raise NonFiniteLoss(
                    f"The training loss became {loss} at step {step}; stopping. The last good checkpoint is "
                    f"{last_good}; lower --learning-rate, raise --warmup-steps, or use --pre-norm."
                )
        self.state.tokens_seen += sum(targets)
        self.tokens_since_log += sum(targets)
        self.last_read["targets"] = targets[-1]
        return self.last_read

    def _after_step(self, result: dict) -> None:
        """Count the step; the callbacks (`on_step_end`) ask for a log record, an evaluation, a checkpoint, which
        follow in that order; a stop signal saves a checkpoint and ends the run here."""
        state, control = self.state, self.control
        control.new_step()
        state.step += 1
        self.unread.append(result)
        self.bar.update(1)
        self._call("on_step_end", result=result)
        record = self._log_record(self._read()) if control.should_log else None
        if control.should_evaluate:
            self._read()
            record = {**(record or {"step": state.step, "tokens_seen": state.tokens_seen}), **self._evaluate()}
        if record is not None:
            self.log(record)
        signal = STOP.received  # checked last: a signal that arrives during the evaluation is heeded at this step
        if signal is not None and self.staged:  # --overwrite: the new run goes, the old one was never touched
            self.bar.close()
            raise TrainingInterrupted(
                f"{signal} received: stopped; {self.args.output_dir} holds the earlier run as it was (--overwrite "
                "replaces it only once the new run is exported)"
            )
        if control.should_save or signal is not None:
            self._read()  # a checkpoint holds no step after a loss that was not a number
            path = self.checkpoints.save(state, self.scheduler, protect=control.keep_step)
            self._call("on_save", path=path)
            if signal is not None:
                self.bar.close()
                raise TrainingInterrupted(f"{signal} received: saved {path}; continue with --resume")

    # ---- observing -------------------------------------------------------------------------------

    def print(self, text: str) -> None:
        """A line of the run's log (main process only), on a line of its own above the progress bar while one
        is showing: printed plainly, it would be glued onto the bar's last redraw."""
        bar = getattr(self, "bar", None)
        if bar is not None and not bar.disable:
            bar.write(text)  # clears the bar, writes the line, draws the bar again below it
        else:
            self.accelerator.print(text)

    def _reset_clock(self) -> None:
        self.tokens_since_log, self.clock, self.data_wait, self.compute = 0, time.perf_counter(), 0.0, 0.0

    def _log_record(self, result: dict) -> dict:
        self.state.train_seconds += time.perf_counter() - self.clock
        busy = max(1e-9, self.data_wait + self.compute)
        grad_norm = result["grad_norm"]
        record = {
            "step": self.state.step,
            "tokens_seen": self.state.tokens_seen,
            "train_loss": result["train_loss"],
            "learning_rate": self.scheduler.get_last_lr()[0],
            "grad_norm": grad_norm,  # None under DeepSpeed
            # throughput of the training steps alone (evaluation and saving excluded)
            "tokens_per_second": self.tokens_since_log / busy,
            "data_wait_share": self.data_wait / busy,
        }
        if self.args.optimizer == "muon":  # the last param group is Muon's (`optim.MuonWithAdamW`)
            record["muon_learning_rate"] = self.scheduler.get_last_lr()[-1]
        self._reset_clock()
        return record

    def _evaluate(self) -> dict:
        """Evaluate, note the best evaluation (the lowest loss) in the state, then `on_evaluate`: the callbacks
        see the loss the best was before this one (early stopping's threshold is measured from it)."""
        metrics = self.evaluate()
        previous_best = self._note_best(metrics["val_loss"])
        self._call("on_evaluate", metrics=metrics, previous_best=previous_best)
        return metrics

    def _note_best(self, val_loss: float) -> float:
        """`state.best_val_loss` and `best_step` after this evaluation; returns the best loss before it."""
        state, previous_best = self.state, self.state.best_val_loss
        if val_loss < previous_best:
            state.best_val_loss, state.best_step = val_loss, state.step
        return previous_best

    def _early_stopping(self, val_loss: float) -> None:
        """One evaluation's verdict outside the loop: the best so far, then the built-in early stopping's count
        (tests drive it alone, on a Trainer made without `__init__`)."""
        EarlyStopping().on_evaluate(self, {"val_loss": val_loss}, previous_best=self._note_best(val_loss))

    # ---- what is exported -------------------------------------------------------------------------

    def unwrapped(self):
        """The trained model itself: no DDP / FSDP wrapper, and not torch.compile's `OptimizedModule` (whose
        state dict names every weight `_orig_mod.*`; accelerate's unwrap_model keeps it by default)."""
        return self.accelerator.unwrap_model(self.uncompiled())

    def uncompiled(self):
        """The prepared model without torch.compile's wrapper (DDP / FSDP stay, for gathering the weights)."""
        return getattr(self.model, "_orig_mod", self.model)

    def load_best(self) -> int:
        """`--export best`: put the weights of the best evaluation's checkpoint back into the model."""
        step = self.state.best_step
        path = self.checkpoints.at(step)
        if not os.path.isdir(path):
            raise MissingFile(f"--export best: the checkpoint of the best step {step} is gone ({path})")
        self.checkpoints.load_weights(path)
        self.accelerator.print(
            f"exporting the weights of step {step} (validation loss {self.state.best_val_loss:.4f})"
        )
        return step

    def log(self, record: dict) -> None:
        """A record of this step (its training and evaluation metrics) joins the run's history, and the
        callbacks get it (`on_log`: metrics.jsonl, trackers, the progress bar)."""
        self.state.history.append(record)
        self._call("on_log", record=record)

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean token loss and perplexity of the model's own loss (all processes) over the validation split,
        or its first `data.eval_batches` batches; a task that trains with label smoothing reports plain
        cross-entropy here."""
        self.model.eval()
        total_loss = torch.zeros((), device=self.accelerator.device)
        total_tokens = torch.zeros((), device=self.accelerator.device)
        for i, batch in enumerate(self.eval_dl):
            if self.data.eval_batches is not None and i >= self.data.eval_batches:
                break
            targets = self.task.count_targets(batch)
            loss = self.model(**batch, num_items_in_batch=targets).loss  # sum over tokens / targets
            total_loss += loss.float() * targets
            total_tokens += targets
        self.model.train()
        total_loss = self.accelerator.reduce(total_loss, "sum")
        total_tokens = self.accelerator.reduce(total_tokens, "sum")
        val_loss = (total_loss / total_tokens.clamp(min=1)).item()
        return {"val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 50.0))}


def next_window(batches, window: int) -> list:
    """Up to `window` micro-batches from a stream's loader; fewer (or none) when the stream ends."""
    try:
        with torch.random.fork_rng(devices=[]):
            return list(itertools.islice(batches, window))
    except ValueError as error:
        # accelerate's dispatcher says so, instead of ending, when a pass holds no batch at all
        if "does not contain any data" not in str(error):
            raise
        return []


def check_compiler() -> None:
    """torch.compile's inductor builds C++ kernels on the CPU (and Triton's launcher on GPUs): without a C++
    compiler it fails at the first step, deep in a traceback; say so before anything runs."""
    names = (os.environ.get("CXX"), "g++", "c++", "clang++")
    if not any(name and shutil.which(name) for name in names):
        raise UsageError(
            "--compile needs a C++ compiler (g++ or clang++) and none was found on the PATH; install one "
            "(e.g. apt-get install g++) or leave out --compile"
        )
