"""The trainer core on `accelerate`: one loop for every task, from a laptop CPU to many GPUs.

    accelerator = Accelerator(...)                     # DDP / FSDP / DeepSpeed come from `accelerate launch`
    model, optimizer, data, schedule = accelerator.prepare(...)
    for each optimizer step:
        for each micro-batch of the accumulation window:
            loss = sum of token losses / target tokens in the whole window, all processes   (exact average)
            backward
        clip gradients; step; schedule; log; evaluate; checkpoint

A task supplies the model, the datasets, a collate function and how to count target tokens.
Checkpoints are `accelerator.save_state` folders written beside their final name and renamed into
place, so an interrupted write never replaces the last good one; SIGTERM and SIGINT save one and stop.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import shutil
import signal
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import DistributedType, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers.utils import logging

from ..tokenization.files import fsync_tree
from .runlock import acquire_run_lock


logger = logging.get_logger("deriv_lm.training")
CHECKPOINT = re.compile(r"^step-(\d+)$")
SCHEDULER_FILE = "scheduler.json"
COMPLETE = "COMPLETE"  # written last, after every file of a checkpoint is on disk


@dataclass
class TrainerState:
    """What the loop needs to continue exactly where it stopped; saved with every checkpoint."""

    step: int = 0  # optimizer steps done
    tokens_seen: int = 0  # target tokens, all processes
    train_seconds: float = 0.0
    best_val_loss: float = math.inf
    history: list = field(default_factory=list)

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "train_seconds": self.train_seconds,
            "best_val_loss": self.best_val_loss,
            "history": self.history,
        }

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def checkpoint_problem(path: str) -> str | None:
    """Why the checkpoint at `path` cannot be resumed from, or None: it lacks the marker written last, a
    weights file is torn (its safetensors header and size disagree), or its JSON state does not parse."""
    from ..hub_card.folder import check_safetensors

    if not os.path.exists(os.path.join(path, COMPLETE)):
        return f"incomplete (no {COMPLETE} marker: its writing was interrupted)"
    try:
        check_safetensors(path)
        for name in ("trainer_state.json", SCHEDULER_FILE):
            with open(os.path.join(path, name), encoding="utf-8") as f:
                json.load(f)
    except (OSError, ValueError) as error:
        return " ".join(str(error).split())
    return None


def read_metrics(path: str) -> list[dict]:
    """The records of metrics.jsonl; a line torn by a kill mid-write is dropped with a warning, not fatal."""
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                record["step"]
            except (ValueError, TypeError, KeyError):
                logger.warning(f"{path}: line {number} is torn or not a metrics record; dropped")
                continue
            records.append(record)
    return records


class TrainingInterrupted(Exception):
    """The process was asked to stop (SIGTERM / SIGINT): in the loop after saving a checkpoint, elsewhere at once."""


class StopRequests:
    """Where SIGTERM and SIGINT go during a run. In the training loop (`defer`) they are noted, and the loop saves
    a checkpoint at the end of the step and stops. Anywhere else (data preparation, export) they stop the run at
    once: every folder is written atomically, so a stop there leaves each as it was."""

    def __init__(self):
        self.defer = False
        self.received: str | None = None
        self.phase = "before training"

    def __call__(self, signum, frame):
        name = signal.Signals(signum).name
        if self.defer:
            self.received = name
            return
        raise TrainingInterrupted(f"{name} received {self.phase}: stopped; no folder was left half-written")


STOP = StopRequests()


@contextmanager
def handle_stop_signals():
    """Route SIGTERM and SIGINT to `STOP` for the duration (the `deriv train` commands wrap the whole run)."""
    previous = {s: signal.signal(s, STOP) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        STOP.defer, STOP.received, STOP.phase = False, None, "before training"
        for s, h in previous.items():
            signal.signal(s, h)


class NonFiniteLoss(Exception):
    pass


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linear and embedding weights) only; never on biases or LayerNorm."""
    decay, no_decay = [], []
    for parameter in model.parameters():
        if parameter.requires_grad:
            (decay if parameter.dim() >= 2 else no_decay).append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(warmup_steps: int, max_steps: int, min_ratio: float) -> Callable[[int], float]:
    """lr(step) / lr_max: linear from 0 over `warmup_steps`, then cosine down to `min_ratio` at `max_steps`."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def inverse_sqrt(warmup_steps: int) -> Callable[[int], float]:
    """The paper's schedule (§5.3), lrate = d^-0.5 min(step^-0.5, step warmup^-1.5), as lr(step) / lr_max:
    linear up to the peak at `warmup_steps`, then decaying as 1/sqrt(step). `learning_rate` is the peak."""

    def factor(step: int) -> float:
        step += 1
        return min(step / warmup_steps, math.sqrt(warmup_steps / step))

    return factor


def choose_mixed_precision(requested: str, cpu: bool) -> str:
    if requested != "auto":
        return requested
    if not cpu and torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"  # bf16 on CPUs is emulated on most machines and slower than fp32


@dataclass
class Task:
    """What a task gives the trainer."""

    model: torch.nn.Module
    train_dataset: object
    eval_dataset: object
    collate: Callable
    count_targets: Callable[[dict], torch.Tensor]  # target tokens in a batch (what the loss averages over)
    # The training loss, given (model, batch, target tokens of the window); None: the model's own loss.
    # Evaluation always uses the model's own loss (a translation task trains with label smoothing but
    # reports the plain cross-entropy).
    compute_loss: Callable | None = None
    # Examples per dataset item: None means args.batch_size examples are collated into a batch; 1 means
    # each item already is a batch (the translation task builds them from pairs of similar length).
    batch_size: int | None = None


class Trainer:
    """Create it first (it owns the Accelerator and seeds every RNG), then build the task, then `train(task)`."""

    def __init__(self, args, cpu: bool = False):
        self.args = args
        self.task: Task | None = None
        self.accelerator = Accelerator(
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            mixed_precision=choose_mixed_precision(args.mixed_precision, cpu),
            log_with="tensorboard" if args.report_to == "tensorboard" else None,
            project_dir=args.output_dir,
            # seedable sampler: the shuffled order is a function of (seed, epoch), so resume can replay it
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
            cpu=cpu,
        )
        if self.accelerator.is_main_process:  # before any work: a second run into the folder stops here
            acquire_run_lock(args.output_dir, say=self.accelerator.print)
        set_seed(args.seed)
        self.state = TrainerState()
        self.scheduler = None  # set by train(); saved as JSON with every checkpoint
        STOP.phase = "while preparing the data"

    # ---- checkpoints -----------------------------------------------------------------------------

    def checkpoints(self) -> list[str]:
        folder = self.args.checkpoint_dir
        if not os.path.isdir(folder):
            return []
        found = [(int(m.group(1)), name) for name in os.listdir(folder) if (m := CHECKPOINT.match(name))]
        return [os.path.join(folder, name) for _, name in sorted(found)]

    def usable_checkpoint(self, found: list[str]) -> str | None:
        """The newest checkpoint that was written completely and whose files read back; a torn one (a kill or
        a full disk mid-write, a truncated copy) is skipped for the one before it, saying why."""
        for path in reversed(found):
            problem = checkpoint_problem(path)
            if problem is None:
                return path
            self.accelerator.print(f"skipping {path}: {problem}")
        return None

    def save_checkpoint(self) -> str:
        """save_state into a temporary folder, then rename it into place; older ones beyond `keep` are removed."""
        final = os.path.join(self.args.checkpoint_dir, f"step-{self.state.step:07d}")
        partial = os.path.join(self.args.checkpoint_dir, f".partial-step-{self.state.step:07d}")
        accelerator = self.accelerator
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(self.args.checkpoint_dir, exist_ok=True)
        accelerator.wait_for_everyone()
        try:
            accelerator.save_state(partial, safe_serialization=True)
            if accelerator.is_main_process:
                # Deriv's own state is JSON, never pickled: a checkpoint folder someone hands you cannot run
                # code when you resume from it.
                with open(os.path.join(partial, "trainer_state.json"), "w") as f:
                    json.dump(self.state.state_dict(), f)
                with open(os.path.join(partial, SCHEDULER_FILE), "w") as f:
                    json.dump(self.scheduler.state_dict(), f)
                fsync_tree(partial)  # the bytes are on disk before the marker says so
                with open(os.path.join(partial, COMPLETE), "w") as f:
                    f.write(f"step {self.state.step}\n")
                    f.flush()
                    os.fsync(f.fileno())
        except OSError as error:
            if accelerator.is_main_process:
                shutil.rmtree(partial, ignore_errors=True)
            previous = self.checkpoints()
            raise OSError(
                f"Could not write the checkpoint for step {self.state.step} ({error}); "
                f"the last good checkpoint is untouched: {previous[-1] if previous else 'none yet'}"
            ) from error
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
            for old in self.checkpoints()[: -self.args.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()
        return final

    def load_checkpoint(self, path: str) -> None:
        """accelerate reads the weights (safetensors), the optimizer and the RNG states with torch's
        `weights_only=True` loader, which refuses anything but tensors and plain containers; nothing
        is registered for its pickled custom objects. The scheduler and trainer state are JSON."""
        try:
            self.accelerator.load_state(path)
        except pickle.UnpicklingError as error:
            raise ValueError(
                f"Cannot resume from {path}: a file there is not plain tensor data and was not loaded "
                f"(torch's weights_only loader refused it: {' '.join(str(error).split())[:300]})"
            ) from error
        except (RuntimeError, ValueError, KeyError) as error:
            raise ValueError(
                f"Cannot resume from {path}: it does not match this model or optimizer ({error}). Resume with "
                "the arguments the run was started with, or start afresh in another --output-dir."
            ) from error
        try:
            with open(os.path.join(path, "trainer_state.json")) as f:
                self.state.load_state_dict(json.load(f))
            with open(os.path.join(path, SCHEDULER_FILE)) as f:
                self.scheduler.load_state_dict(json.load(f))
        except (OSError, ValueError) as error:
            raise ValueError(
                f"Cannot resume from {path}: its trainer or scheduler state is unreadable ({error})"
            ) from error

    @contextmanager
    def _deferred_stop(self):
        """In the loop a stop request waits for the end of the step; outside `deriv train` (the Python API) the
        handlers are installed for the loop alone."""
        installed = signal.getsignal(signal.SIGTERM) is STOP
        with nullcontext() if installed else handle_stop_signals():
            STOP.defer, STOP.received = True, None
            try:
                yield
            finally:
                STOP.defer = False

    # ---- the loop --------------------------------------------------------------------------------

    def _dataloader(self, dataset, shuffle: bool) -> DataLoader:
        generator = torch.Generator().manual_seed(self.args.seed)
        return DataLoader(
            dataset,
            batch_size=self.task.batch_size or self.args.batch_size,
            shuffle=shuffle,
            collate_fn=self.task.collate,
            generator=generator,
            drop_last=shuffle,
        )

    @torch.no_grad()
    def evaluate(self, model, dataloader) -> dict:
        """Mean token loss and perplexity over the first `eval_batches` validation batches (all processes)."""
        model.eval()
        total_loss = torch.zeros((), device=self.accelerator.device)
        total_tokens = torch.zeros((), device=self.accelerator.device)
        for i, batch in enumerate(dataloader):
            if i >= self.args.eval_batches:
                break
            targets = self.task.count_targets(batch)
            loss = model(**batch, num_items_in_batch=targets).loss  # sum over tokens / targets
            total_loss += loss.float() * targets
            total_tokens += targets
        model.train()
        total_loss = self.accelerator.reduce(total_loss, "sum")
        total_tokens = self.accelerator.reduce(total_tokens, "sum")
        val_loss = (total_loss / total_tokens.clamp(min=1)).item()
        return {"val_loss": val_loss, "val_perplexity": math.exp(min(val_loss, 50.0))}

    def train(self, task: Task) -> TrainerState:
        args, accelerator = self.args, self.accelerator
        self.task = task
        model = task.model
        optimizer = torch.optim.AdamW(
            parameter_groups(model, args.weight_decay), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2)
        )
        # The schedule counts optimizer steps; prepare() would step it once per process, so it stays unprepared.
        schedule = (
            inverse_sqrt(args.warmup_steps)
            if args.lr_schedule == "inverse_sqrt"
            else warmup_cosine(args.warmup_steps, args.max_steps, args.min_lr_ratio)
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        train_dl = self._dataloader(self.task.train_dataset, shuffle=True)
        eval_dl = self._dataloader(self.task.eval_dataset, shuffle=False)
        model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
        self.scheduler = scheduler  # checkpointed as JSON by save_checkpoint, not by accelerate's pickles

        found = self.checkpoints()
        usable = self.usable_checkpoint(found) if args.resume else None
        if usable:
            self.load_checkpoint(usable)
            accelerator.print(f"resumed from {usable} at step {self.state.step}")
        elif args.resume:
            accelerator.print(f"--resume: no checkpoint in {args.checkpoint_dir}; starting from step 0")
        elif found and accelerator.is_main_process:
            # A fresh run owns its folder: older checkpoints would be mistaken for its own when resuming.
            accelerator.print(
                f"starting afresh: removing {len(found)} checkpoint(s) of an earlier run in "
                f"{args.checkpoint_dir} (use --resume to continue it)"
            )
            for path in found:
                shutil.rmtree(path)
        accelerator.wait_for_everyone()
        if args.report_to != "none":
            accelerator.init_trackers(
                "deriv", config={k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))}
            )

        window = args.gradient_accumulation_steps
        deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
        batches_per_epoch = len(train_dl)
        if batches_per_epoch < window:
            raise ValueError(
                f"The training split gives {batches_per_epoch} batch(es) per process, fewer than one accumulation "
                f"window of {window}; use a smaller --batch-size or a larger corpus."
            )
        steps_per_epoch = batches_per_epoch // window
        metrics_path = os.path.join(args.output_dir, "metrics.jsonl")
        os.makedirs(args.output_dir, exist_ok=True)
        if accelerator.is_main_process and os.path.exists(metrics_path):
            # Keep what the checkpoint we continue from had logged; drop the rest (or all, on a fresh run).
            kept = [
                json.dumps(record) + "\n" for record in read_metrics(metrics_path) if record["step"] <= self.state.step
            ]
            with open(metrics_path, "w") as f:
                f.writelines(kept)
        bar = tqdm(
            total=args.max_steps,
            initial=self.state.step,
            desc="training",
            unit="step",
            disable=not (args.progress and accelerator.is_main_process),
            dynamic_ncols=True,
        )
        model.train()
        tokens_since_log, clock = 0, time.perf_counter()
        data_wait = compute = 0.0

        with self._deferred_stop():
            while self.state.step < args.max_steps:
                epoch, step_in_epoch = divmod(self.state.step, steps_per_epoch)
                train_dl.set_epoch(epoch)
                # subtle: on resume, replay the same shuffled order and skip what was already seen.
                loader = (
                    accelerator.skip_first_batches(train_dl, step_in_epoch * window) if step_in_epoch else train_dl
                )
                iterator = iter(loader)
                for _ in range(step_in_epoch, steps_per_epoch):
                    if self.state.step >= args.max_steps:
                        break
                    start = time.perf_counter()
                    micro_batches = [next(iterator) for _ in range(window)]
                    data_wait += time.perf_counter() - start
                    start = time.perf_counter()
                    # Average over every target token of the window on every process: an exact mean,
                    # whatever the accumulation, the number of processes and the padding.
                    local = sum(self.task.count_targets(b) for b in micro_batches)
                    global_targets = accelerator.reduce(local.detach().clone(), "sum")
                    loss_sum = torch.zeros((), device=accelerator.device)
                    for i, batch in enumerate(micro_batches):
                        last = i == window - 1
                        # As transformers' Trainer does: the window is fetched ahead (to count its tokens), so
                        # tell accelerate which micro-batch ends it instead of letting it guess from the loader.
                        accelerator.gradient_state._set_sync_gradients(last)
                        with accelerator.no_sync(model) if not last and not deepspeed else nullcontext():
                            if self.task.compute_loss is not None:
                                loss = self.task.compute_loss(model, batch, global_targets)
                            else:
                                loss = model(**batch, num_items_in_batch=global_targets).loss
                            loss_sum += loss.detach().float()
                            # backward divides by `window` and DDP averages over processes: undo both.
                            accelerator.backward(loss * window * accelerator.num_processes)
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    scheduler.step()
                    train_loss = accelerator.reduce(loss_sum, "sum").item()
                    if not math.isfinite(train_loss):
                        last_good = (self.checkpoints() or ["none"])[-1]
                        raise NonFiniteLoss(
                            f"The training loss became {train_loss} at step {self.state.step + 1}; stopping. "
                            f"The last good checkpoint is {last_good}"
                            "; lower --learning-rate, raise --warmup-steps, or use --pre-norm."
                        )
                    compute += time.perf_counter() - start
                    self.state.step += 1
                    n_tokens = int(global_targets.item())
                    self.state.tokens_seen += n_tokens
                    tokens_since_log += n_tokens
                    bar.update(1)

                    record = None
                    if self.state.step % args.log_every == 0 or self.state.step == args.max_steps:
                        elapsed = time.perf_counter() - clock
                        self.state.train_seconds += elapsed
                        record = {
                            "step": self.state.step,
                            "tokens_seen": self.state.tokens_seen,
                            "train_loss": train_loss,
                            "learning_rate": scheduler.get_last_lr()[0],
                            "grad_norm": None if grad_norm is None else float(grad_norm),  # None under DeepSpeed
                            # throughput of the training steps alone (evaluation and saving excluded)
                            "tokens_per_second": tokens_since_log / max(1e-9, data_wait + compute),
                            "data_wait_share": data_wait / max(1e-9, data_wait + compute),
                        }
                        bar.set_postfix(
                            loss=f"{train_loss:.3f}",
                            lr=f"{record['learning_rate']:.1e}",
                            tok_s=f"{record['tokens_per_second']:.0f}",
                        )
                        tokens_since_log, clock, data_wait, compute = 0, time.perf_counter(), 0.0, 0.0
                    if self.state.step % args.eval_every == 0 or self.state.step == args.max_steps:
                        evaluation = self.evaluate(model, eval_dl)
                        self.state.best_val_loss = min(self.state.best_val_loss, evaluation["val_loss"])
                        record = {
                            **(record or {"step": self.state.step, "tokens_seen": self.state.tokens_seen}),
                            **evaluation,
                        }
                        accelerator.print(
                            f"step {self.state.step}: validation loss {evaluation['val_loss']:.4f}, "
                            f"perplexity {evaluation['val_perplexity']:.2f}"
                        )
                    if record is not None:
                        self.state.history.append(record)
                        if accelerator.is_main_process:
                            with open(metrics_path, "a") as f:
                                f.write(json.dumps(record) + "\n")
                        if args.report_to != "none":
                            accelerator.log({k: v for k, v in record.items() if k != "step"}, step=self.state.step)
                    stop = STOP.received is not None
                    if self.state.step % args.save_every == 0 or stop:
                        path = self.save_checkpoint()
                        if stop:
                            bar.close()
                            raise TrainingInterrupted(
                                f"{STOP.received} received: saved {path}; continue with --resume"
                            )
        bar.close()
        STOP.phase = "while exporting (the output folder is as it was; continue with --resume)"
        if args.report_to != "none":
            accelerator.end_training()
        self.model = model
        return self.state
