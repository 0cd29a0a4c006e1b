"""The driver: every step a training run shares, done once, for any task (`task.py`), naming none.

initial = task.open_init_from()         with --init-from: its model, checked before anything is read or written
trainer = Trainer(args)                 accelerator, run lock, seeds
source = task.read()                    read and split the data (nothing is trained on it before)
tokenizer = the given one, or one trained on the training split only (source.tokenizer_texts)
data = task.prepare(source, tokenizer)  the tokenized sets, the collator, the training order, the data record
model = task.build_model(tokenizer), or task.from_folder(initial, tokenizer); then task.start(...)
trainer.train(model, task, data)        the loop, checkpoints, resume, evaluation
gather the weights; validation metrics; task.finish (the task's model, metrics, card text, samples); run record;
export; then task.score_exported (the test BLEU: the folder exists before it starts), added to run.json and the
card; samples
"""

from __future__ import annotations

import inspect
import os
import sys
import time
from collections.abc import Sized
from contextlib import contextmanager

from accelerate.utils import DistributedType

from ..errors import MissingFile, UsageError
from ..folder.atomic import end_staging, staging_folder, start_staging
from ..folder.load import checked_files, tokenizer_file
from ..folder.remote_code import check_tokenizer_code
from ..folder.target import check_no_collision, check_target, mark
from ..modeling_deriv import DerivConfig
from ..tokenization.bpe import characters_per_token, save_tokenizer, special_tokens_with, train_bpe
from .distributed import describe, whole_model
from .export import add_to_record, export_folder, run_record
from .runlock import LOCK_FILE, holds_run_lock, releases_run_lock
from .trainer import Trainer


@releases_run_lock
def run(args, task, cpu: bool = False, callbacks=None) -> str:
    """Train `task` as `args` say; returns the exported folder."""
    started = time.perf_counter()
    check_output_dir(args)
    # a folder that cannot start the run stops it here, before the run lock makes its folder
    initial = task.open_init_from() if args.init_from else None
    with staged(args):
        return _train(args, task, initial, started, cpu, callbacks)


def _train(args, task, initial, started: float, cpu: bool, callbacks) -> str:
    trainer = Trainer(args, cpu=cpu, callbacks=callbacks)  # callbacks: after the built-in ones (callbacks.py)
    accelerator = trainer.accelerator
    if accelerator.is_main_process:
        claim_work_dir(args)
    _datasets_bars(trainer.bars)  # datasets' map bars (tokenizing, packing) follow the run's: on a terminal only
    task.say = accelerator.print
    accelerator.print(args.describe())  # the resolved settings, by concern (the main process's)
    source = task.read()
    tokenizer = load_or_train_tokenizer(args, source.tokenizer_texts, accelerator)
    with accelerator.main_process_first():
        data = task.prepare(source, tokenizer)
    if initial is None:
        model = task.build_model(tokenizer)
    else:
        model = task.from_folder(initial, tokenizer)
        del initial  # the run owns it now
    model, data = task.start(model, tokenizer, source, data)
    if args.init_from:
        accelerator.print(f"starting from the weights in {args.init_from}")
    n_params = sum(p.numel() for p in model.parameters())
    training = len(data.train) if isinstance(data.train, Sized) else "streamed"  # a stream has no length
    accelerator.print(
        f"model: {n_params / 1e6:.2f} M parameters; {training} training and {len(data.validation)} "
        f"validation {data.unit}; {describe(accelerator)}"
    )
    trainer.train(model, task, data)
    accelerator.wait_for_everyone()
    if args.export == "best" and trainer.state.best_step != trainer.state.step:
        trainer.load_best()
    # A collective: under FSDP or DeepSpeed ZeRO-3 the full weights are gathered from every process. Not from
    # the compiled wrapper, whose weight names would all start `_orig_mod.`.
    state_dict = accelerator.get_state_dict(trainer.uncompiled())
    if accelerator.is_main_process:
        finish(trainer, task, tokenizer, source, data, state_dict, time.perf_counter() - started)
    accelerator.wait_for_everyone()
    return args.output_dir


# What a folder holds once a run has been in it: its checkpoints, its log, its exported model and record.
RUN_FILES = ("checkpoints", "metrics.jsonl", "model.safetensors", "run.json")
# What a run writes into its folder as it goes (the trackers' last: dvclive's folder, tensorboard's `deriv`), and
# what its export writes: a folder of the user's (--allow-existing-files) must hold none of these.
WORK_FILES = ("checkpoints", "metrics.jsonl", "tokenizer", "dvclive", "deriv")
EXPORT_FILES = (
    *("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json", "run.json"),
    *("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "README.md"),
    *("pipeline_deriv.py", "loss.png", "adapter"),
)


def export_names() -> tuple[str, ...]:
    """Every top-level name an export may write: the files above and the model code save_pretrained copies."""
    code = os.path.dirname(inspect.getfile(DerivConfig))
    files = sorted(name for name in os.listdir(code) if name.endswith(".py") and name != "__init__.py")
    return EXPORT_FILES + tuple(files)


def check_output_dir(args) -> None:
    """May this run write its folder? Never the root, the home folder, the working directory or a mount point;
    a folder of the user's only with --allow-existing-files, and none of its files replaced; --overwrite
    replaces a Deriv run only (`folder.target`). A folder that holds a run is continued (--resume) or replaced
    (--overwrite), never replaced unasked: a second `deriv train` into it would empty its metrics at step 0."""
    folder = args.output_dir
    check_target(folder, "--output-dir", allow_existing=args.allow_existing_files, replace=args.overwrite)
    check_no_collision(folder, WORK_FILES + export_names())
    if args.resume or args.overwrite or not os.path.isdir(folder):
        return
    held = [name for name in RUN_FILES if os.path.exists(os.path.join(folder, name))]
    held = [name for name in held if name != "checkpoints" or os.listdir(os.path.join(folder, name))]
    if held:
        raise UsageError(
            f"{folder} holds a run ({', '.join(held)}): continue it with --resume, start afresh over it with "
            "--overwrite, or give another --output-dir"
        )


@contextmanager
def staged(args):
    """--overwrite of a folder that holds something: the run works in a staging folder beside it
    (`args.work_dir`), and its export swaps the new run in whole; until then the old run, checkpoints included,
    is untouched. Stopped or failed, the staging folder goes and the old run stays as it was; killed, the next
    writer of the folder removes it. The main process makes it once it holds the run lock (`claim_work_dir`)."""
    folder = args.output_dir
    if not (args.overwrite and os.path.isdir(folder) and os.listdir(folder)):
        yield
        return
    run_args = args.parts["run"]
    run_args._work_dir = staging_folder(folder)
    try:
        yield
    finally:
        run_args._work_dir = None
        if holds_run_lock(folder):  # not a run that stopped at the lock: the folder is another run's
            end_staging(folder)


def claim_work_dir(args) -> None:
    """Main process, holding the run lock: the folder the run writes into as it goes (the staging folder under
    --overwrite, made afresh) is marked with the names the run writes there, so the user's files beside them
    (--allow-existing-files) stay theirs."""
    if args.work_dir != args.output_dir:
        start_staging(args.output_dir)
        try:  # the export carries the held lock into the new run (a link to the same file)
            os.link(os.path.join(args.output_dir, LOCK_FILE), os.path.join(args.work_dir, LOCK_FILE))
        except OSError:
            pass  # a filesystem without hard links: the lock's file goes with the old run at the swap
    trackers = WORK_FILES[3:] if args.report_to != "none" else ()
    mark(args.work_dir, WORK_FILES[:3] + trackers)


def _datasets_bars(on: bool) -> None:
    import datasets

    (datasets.enable_progress_bars if on else datasets.disable_progress_bars)()


def load_or_train_tokenizer(args, texts, accelerator):
    """An existing tokenizer (--init-from's, --tokenizer, or the one an earlier run of this output_dir trained), or
    a new one trained on `texts()`: the training split only, so validation and test text is never seen by it."""
    from transformers import AutoTokenizer

    if args.init_from and args.tokenizer:
        raise UsageError("--init-from brings its own tokenizer; leave out --tokenizer (or --init-from).")
    given = args.init_from or args.tokenizer
    folder = given or os.path.join(args.work_dir, "tokenizer")
    with accelerator.main_process_first():  # one process trains and saves; the others then load
        # subtle: a given folder may keep a tokenizer with no tokenizer.json (an imported OPUS-MT's SentencePiece)
        if given and tokenizer_file(given) is None:
            raise MissingFile(f"No tokenizer.json in {given}")
        if given:  # a tokenizer that is the folder's own code: refused (folder/remote_code.py), never asked about
            check_tokenizer_code(given, consent=None)
        if not given and not os.path.exists(os.path.join(folder, "tokenizer.json")):
            progress = args.progress and accelerator.is_main_process and sys.stderr.isatty()  # bars on a terminal only
            tokenizer, summary = train_bpe(texts(), args.vocab_size, special_tokens_with(), progress=progress)
            save_tokenizer(tokenizer, folder, model_max_length=args.max_position_embeddings)
            accelerator.print(
                f"tokenizer: {summary.vocab_size} ids from {summary.characters / 1e6:.2f} M characters "
                f"in {summary.seconds:.2f} s -> {folder}"
            )
        checked_files(folder)  # a link out or a FIFO among its files: refused by name, never read (folder/inside.py)
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    if len(tokenizer) != args.vocab_size:
        # The model's vocabulary is the tokenizer's; record the size that was used, not the one asked for.
        accelerator.print(
            f"note: the tokenizer in {folder} has {len(tokenizer)} ids, not --vocab-size {args.vocab_size}; "
            f"the model uses {len(tokenizer)}"
        )
        args.vocab_size = len(tokenizer)
    return tokenizer


def finish(trainer, task, tokenizer, source, data, state_dict, seconds: float) -> None:
    """Main process: the exported weights' metrics, the task's ending (`task.finish`), the run record, the
    exported folder, then the task's slow scores (`task.score_exported`) added to it, the task's samples."""
    args, accelerator, state = trainer.args, trainer.accelerator, trainer.state
    model = trainer.unwrapped()
    if accelerator.distributed_type == DistributedType.FSDP:
        # A sharded model runs only with every process taking part; what follows runs on this one alone.
        model, state_dict = whole_model(task.model_class, model.config, state_dict), None
    evaluated = [r for r in state.history if "val_loss" in r]
    exported = state.best_step if args.export == "best" and state.best_step is not None else state.step
    # the metrics of the exported weights: the best evaluation's with --export best, else the last one's
    final = next((r for r in reversed(evaluated) if r["step"] == exported), evaluated[-1] if evaluated else {})
    metrics = {"val_loss": final.get("val_loss"), "val_perplexity": final.get("val_perplexity")}
    outcome = task.finish(model, state_dict, tokenizer, source, data, metrics)
    ratio = characters_per_token(tokenizer, source.sample_texts())
    record = run_record(task, args, data, outcome, tokenizer, ratio, state, accelerator, seconds, metrics, exported)
    export_folder(
        args.output_dir,
        outcome.model,
        outcome.state_dict,
        tokenizer,
        record,
        state.history,
        accelerator.print,
        task.pipeline_class,
        outcome.write_files,
        staging=args.work_dir if args.work_dir != args.output_dir else None,
    )
    scored = task.score_exported(outcome, tokenizer, source, data, metrics)
    if scored is not None:
        outcome = scored
        values = (tokenizer, ratio, state, accelerator, seconds, metrics, exported)
        add_to_record(args.output_dir, run_record(task, args, data, outcome, *values))
    for line in outcome.samples:
        accelerator.print(line)
    summary = f"validation perplexity {metrics['val_perplexity']:.2f}" + outcome.summary
    # the steps, tokens and training seconds are the whole run's, across resumes; this process's wall time beside
    this = f"; this process {seconds:.0f} s from step {trainer.resumed_at}" if trainer.resumed_at is not None else ""
    accelerator.print(
        f"done: {state.step} steps, {state.tokens_seen / 1e6:.2f} M {data.token_kind} in "
        f"{state.train_seconds:.0f} s of training{this}; {summary}\nmodel folder: {os.path.abspath(args.output_dir)}"
    )
