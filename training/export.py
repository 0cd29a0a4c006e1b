"""What every training task ends with: the run record and the exported model folder."""

from __future__ import annotations

import json
import os
import platform
import re

import torch

from ..folder.atomic import atomic_directory
from ..folder.curve import plot_losses
from ..folder.record import (
    CardRecord,
    DataRecord,
    HardwareRecord,
    MetricsRecord,
    ModelRecord,
    ProcedureRecord,
    RunRecord,
    TokenizerRecord,
    TrainingRecord,
)
from ..hub_card import write_card
from ..tokenization.bpe import make_portable


# An absolute path in text: a "/" not preceded by a word character, a colon or another "/" (so not a URL or a
# relative path), then everything up to a quote, a space, a bracket or a comma.
_ABSOLUTE_PATH = re.compile(r"(?<![\w:/.])/[^\s'\",\]\)]+")


def without_local_paths(value, run_dir: str):
    """`value` (JSON-like) with every absolute local path made portable (`_portable`): run.json and the card are
    published with the model, and must not carry the user's home folder or machine layout."""
    run_dir = os.path.abspath(run_dir)
    if isinstance(value, dict):
        return {k: without_local_paths(v, run_dir) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_local_paths(v, run_dir) for v in value]
    if isinstance(value, str):
        if value and not os.path.isabs(value) and os.sep in value and os.path.exists(value):
            value = os.path.abspath(value)  # a path relative to where the command ran: say it from the run
        return _ABSOLUTE_PATH.sub(lambda m: _portable(m.group(0), run_dir), value)
    return value


def _portable(path: str, run_dir: str) -> str:
    """Inside the run folder: relative to it ("." for the folder). Elsewhere: the file or folder name alone,
    since a relative path out of the run folder would still spell the directories above it."""
    if path == run_dir or path.startswith(run_dir + os.sep):
        return os.path.relpath(path, run_dir)
    return os.path.basename(path.rstrip(os.sep)) or path


def run_record(
    task, args, data, outcome, tokenizer, chars_per_token, state, accelerator, seconds, metrics, exported_step
):
    """What produced an exported folder (run.json, the `folder.record` schema): the card reads it. `data` is the
    task's `TaskData` (its `record` the data section), `outcome` its `Outcome` (its own procedure fields,
    metrics and card text); nothing here knows which task ran."""
    import accelerate
    import datasets
    import tokenizers
    import transformers

    model = outcome.model
    record = RunRecord(
        task=task.name,
        arguments=args.by_concern(),
        data=DataRecord(**data.record),
        tokenizer=TokenizerRecord(len(tokenizer), chars_per_token, tokenizer.all_special_tokens),
        model=ModelRecord(sum(p.numel() for p in model.parameters()), model.config.to_diff_dict()),
        procedure=ProcedureRecord(
            preset=args.preset,
            optimizer=optimizer_name(args),
            adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2,
            weight_decay=args.weight_decay,
            learning_rate=args.learning_rate,
            lr_schedule=args.lr_schedule,
            warmup_steps=args.warmup_steps,
            batch_size=args.batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            dropout=args.dropout,
            max_grad_norm=args.max_grad_norm,
            seed=args.seed,
            task=outcome.procedure,
        ),
        training=training_record(args, state, seconds, exported_step, data.token_kind),
        hardware=HardwareRecord(
            device=str(accelerator.device),
            processes=accelerator.num_processes,
            distributed=accelerator.distributed_type.value,
            mixed_precision=accelerator.mixed_precision,
            torch_threads=torch.get_num_threads(),
            platform=platform.platform(),
            processor=platform.processor() or platform.machine(),
            gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        ),
        versions={
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "accelerate": accelerate.__version__,
            "datasets": datasets.__version__,
            "tokenizers": tokenizers.__version__,
        },
        metrics=MetricsRecord(**metrics, task=outcome.metrics),
        card=CardRecord(**outcome.card),
        base_model=args.init_from,  # made portable below, as every path in the record is
    )
    return without_local_paths(record.to_dict(), args.output_dir)


def optimizer_name(args) -> str:
    """The optimizer as the card states it (its betas and weight decay follow it there)."""
    if args.optimizer == "muon":
        return (
            f"Muon on the blocks' linear weights (peak learning rate {args.muon_learning_rate:g}, momentum "
            f"{args.muon_momentum:g}), AdamW on the rest"
        )
    return "AdamW"


def training_record(args, state, seconds: float, exported_step: int, token_kind: str = "tokens") -> TrainingRecord:
    """How long it ran, why it stopped, whose weights the folder holds, and how it computed."""
    return TrainingRecord(
        state.step,
        state.tokens_seen,
        state.train_seconds,
        seconds,
        stop_reason=state.stop_reason or "max_steps",
        exported_step=exported_step,
        best_step=state.best_step,
        gradient_checkpointing=args.gradient_checkpointing,
        compiled=args.compile,
        token_kind=token_kind,
    )


def export_folder(
    output_dir,
    model,
    state_dict,
    tokenizer,
    record,
    history,
    say=print,
    pipeline_class=None,
    extras=None,
    staging=None,
) -> None:
    """Weights (safetensors) + model code + tokenizer + generation defaults + run.json + loss.png, written
    into a temporary folder and renamed into place: the files appear together or not at all.

    The run's own files (checkpoints, metrics.jsonl, its tokenizer) come along: from the folder, or, for a run
    that replaces the run there (--overwrite), from its `staging` folder, and then none of the old run's files
    are kept (only files of the user's, which Deriv never removes).

    With `pipeline_class`, the folder also carries that pipeline (`custom_pipelines` in config.json and
    its code), so `pipeline(model=folder, trust_remote_code=True)` works without this package. `extras(folder)`
    writes the task's own files into the folder before the card (a LoRA adapter).
    """
    # subtle: batched calls with padding=True / truncation (the BLEU decode) leave that state in the backend,
    # and save_pretrained writes it into tokenizer.json, where plain `tokenizers` users would inherit it.
    if hasattr(tokenizer, "backend_tokenizer"):  # a SentencePiece tokenizer (an imported OPUS-MT's) has none
        tokenizer.backend_tokenizer.no_padding()
        tokenizer.backend_tokenizer.no_truncation()
    with atomic_directory(output_dir, replace=staging is not None, carry_from=staging) as tmp:
        if pipeline_class is not None:
            # Pipeline.save_pretrained writes custom_pipelines, copies the pipeline module, then saves the
            # model (the gathered state dict passes through) and the tokenizer.
            pipeline_class(model=model, tokenizer=tokenizer).save_pretrained(tmp, state_dict=state_dict)
        else:
            model.save_pretrained(tmp, state_dict=state_dict)
            tokenizer.save_pretrained(tmp)
        make_portable(tmp)
        with open(os.path.join(tmp, "run.json"), "w") as f:
            json.dump(record, f, indent=2, default=str)
        if extras is not None:
            extras(tmp)
        if not plot_losses(history, os.path.join(tmp, "loss.png")):
            say("loss.png skipped: pip install matplotlib (or deriv-lm[viz]) to plot the curves")
        # README.md, from the files just written; named after the final folder, not the temporary one
        write_card(tmp, repo_id=os.path.basename(os.path.abspath(output_dir)))


def add_to_record(output_dir, record) -> None:
    """What a run adds to its exported folder once it is scored (the test BLEU): run.json replaced by `record` and
    the card rebuilt from it, swapped in together, so a run stopped while scoring keeps the folder as exported."""
    with atomic_directory(output_dir, carry_first=True) as tmp:
        path = os.path.join(tmp, "run.json")
        with open(path + ".partial", "w") as f:
            json.dump(record, f, indent=2, default=str)
        os.replace(path + ".partial", path)  # subtle: never write through the link to the exported run.json
        write_card(tmp, repo_id=os.path.basename(os.path.abspath(output_dir)))
