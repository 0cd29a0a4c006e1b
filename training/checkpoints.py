"""Checkpoints: `accelerator.save_state` folders that appear whole or not at all, and their JSON state.

    output_dir/checkpoints/step-0000200/   model.safetensors, optimizer.bin, random states (accelerate),
                                           trainer_state.json, scheduler.json (ours: JSON, never pickled),
                                           COMPLETE (written last)

Under FSDP the weights and the optimizer are sharded, one folder each in torch's distributed checkpoint
format (`pytorch_model_fsdp_0/`, `optimizer_0/`: a `.distcp` file per process and a `.metadata` index).

A checkpoint is written into `.partial-step-N` beside its final name and renamed into place, so an
interrupted write never replaces the last good one; resuming skips a torn one for the one before it.
"""

from __future__ import annotations

import json
import logging as _logging
import math
import os
import pickle
import re
import shutil
from dataclasses import asdict, dataclass, field

from transformers.utils import logging

from ..errors import UsageError
from ..folder.atomic import fsync_tree


logger = logging.get_logger("deriv_lm.training")
# subtle: accelerate's save_state drops `lm_head.weight` from the safetensors file, since it is `embed_tokens.weight`
# itself (tied), and warns "Removed shared tensor ... check ... that you don't receive any warning while reloading"
# at every checkpoint. The model re-ties on load, and a resumed run ends bit-identical (tests/test_training.py,
# tests/test_sft.py): the warning is noise here, so that one line is dropped.
_logging.getLogger("accelerate.utils.other").addFilter(
    lambda record: "Removed shared tensor" not in record.getMessage()
)
CHECKPOINT = re.compile(r"^step-(\d+)$")
SCHEDULER_FILE = "scheduler.json"
STATE_FILE = "trainer_state.json"
COMPLETE = "COMPLETE"  # written last, after every file of a checkpoint is on disk


@dataclass
class TrainerState:
    """What the loop needs to continue exactly where it stopped; saved with every checkpoint."""

    step: int = 0  # optimizer steps done
    tokens_seen: int = 0  # target tokens, all processes
    train_seconds: float = 0.0
    best_val_loss: float = math.inf
    best_step: int | None = None  # the evaluation with the lowest validation loss
    evals_without_improvement: int = 0  # early stopping's count, kept here so that resume continues it
    stop_reason: str | None = None  # "early_stopping" once it stops the run; None: it runs to max_steps
    epoch: int = 0  # a stream's pass (its shuffle order); map-style data count epochs from the step instead
    epoch_start_step: int = 0  # the step at which the stream's current pass began
    history: list = field(default_factory=list)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


def checkpoint_problem(path: str) -> str | None:
    """Why the checkpoint at `path` cannot be resumed from, or None: it lacks the marker written last, a
    weights file is torn (its safetensors header and size disagree), or its JSON state does not parse."""
    from ..folder.load import check_safetensors

    if not os.path.exists(os.path.join(path, COMPLETE)):
        return f"incomplete (no {COMPLETE} marker: its writing was interrupted)"
    try:
        check_safetensors(path)
        for name in (STATE_FILE, SCHEDULER_FILE):
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


class Checkpoints:
    """The checkpoints of one run folder, for one accelerator (every process calls save and load)."""

    def __init__(self, accelerator, folder: str, keep: int, settings: str = "these settings"):
        self.accelerator, self.folder, self.keep = accelerator, folder, keep
        self.settings = settings  # what built the model, for a refusal: "--preset small"

    def found(self) -> list[str]:
        if not os.path.isdir(self.folder):
            return []
        steps = [(int(m.group(1)), name) for name in os.listdir(self.folder) if (m := CHECKPOINT.match(name))]
        return [os.path.join(self.folder, name) for _, name in sorted(steps)]

    def newest_usable(self) -> str | None:
        """The newest checkpoint that was written completely and whose files read back; a torn one (a kill or
        a full disk mid-write, a truncated copy) is skipped for the one before it, saying why."""
        for path in reversed(self.found()):
            problem = checkpoint_problem(path)
            if problem is None:
                return path
            self.accelerator.print(f"skipping {path}: {problem}")
        return None

    def remove_all(self) -> None:
        """A fresh run owns its folder: older checkpoints would be mistaken for its own when resuming."""
        found = self.found()
        if found and self.accelerator.is_main_process:
            self.accelerator.print(
                f"starting afresh: removing {len(found)} checkpoint(s) of an earlier run in "
                f"{self.folder} (use --resume to continue it)"
            )
            for path in found:
                shutil.rmtree(path)
        self.accelerator.wait_for_everyone()

    def at(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step:07d}")

    def save(self, state: TrainerState, scheduler, protect: int | None = None) -> str:
        """save_state into a temporary folder, then rename it into place; older ones beyond `keep` are removed,
        but for the checkpoint of step `protect` (`--export best` keeps the best evaluation's this way)."""
        final = self.at(state.step)
        partial = os.path.join(self.folder, f".partial-step-{state.step:07d}")
        accelerator = self.accelerator
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(self.folder, exist_ok=True)
        accelerator.wait_for_everyone()
        try:
            accelerator.save_state(partial, safe_serialization=True)
            if accelerator.is_main_process:
                _write_own_state(partial, state, scheduler)
        except OSError as error:
            if accelerator.is_main_process:
                shutil.rmtree(partial, ignore_errors=True)
            previous = self.found()
            raise OSError(
                f"Could not write the checkpoint for step {state.step} ({error}); "
                f"the last good checkpoint is untouched: {previous[-1] if previous else 'none yet'}"
            ) from error
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
            for old in self.found()[: -self.keep]:
                if protect is None or old != self.at(protect):
                    shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()
        return final

    def load(self, path: str, state: TrainerState, scheduler) -> None:
        """accelerate reads the weights (safetensors), the optimizer and the RNG states with torch's
        `weights_only=True` loader, which refuses anything but tensors and plain containers; nothing
        is registered for its pickled custom objects. The scheduler and trainer state are JSON. A sharded
        (FSDP) checkpoint's `.metadata` index, which torch unpickles as it is, is read first with only its own
        classes allowed (`check_sharded_metadata`)."""
        self.load_weights(path)
        try:
            with open(os.path.join(path, STATE_FILE)) as f:
                state.load_state_dict(json.load(f))
            with open(os.path.join(path, SCHEDULER_FILE)) as f:
                scheduler.load_state_dict(json.load(f))
        except (OSError, ValueError) as error:
            raise UsageError(
                f"Cannot resume from {path}: its trainer or scheduler state is unreadable ({error})"
            ) from error

    def load_weights(self, path: str) -> None:
        """The weights, optimizer and RNG states of the checkpoint at `path` (accelerate's part), safely."""
        try:
            check_sharded_metadata(path)
            self.accelerator.load_state(path)
        except pickle.UnpicklingError as error:
            raise UsageError(
                f"Cannot resume from {path}: a file there is not plain tensor data and was not loaded "
                f"(torch's weights_only loader refused it: {' '.join(str(error).split())[:300]})"
            ) from error
        except (RuntimeError, ValueError, KeyError) as error:
            cause = " ".join(str(error).split())
            cause = cause if len(cause) <= 300 else cause[:300] + " ..."
            raise UsageError(
                f"Cannot resume from {path}: it does not match the model or optimizer {self.settings} build "
                f"({cause}). Resume with the preset and arguments the run was started with, or start afresh with "
                "--overwrite or another --output-dir."
            ) from error


# What the `.metadata` index of torch's distributed checkpoint holds: its own dataclasses, tensor shapes, dtypes
# and layouts, and the path it was written to. Nothing here runs code when it is built.
_SHARDED_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class _ShardedMetadataUnpickler(pickle.Unpickler):
    """Python's "restricting globals" unpickler: a class or function outside the allowed set is refused
    before it is looked up, so a planted `.metadata` cannot run code (torch's own weights-only loader cannot
    read this file: it is pickle protocol 4, framed)."""

    def find_class(self, module: str, name: str):
        import torch

        allowed = (module, name) in _SHARDED_METADATA_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a sharded checkpoint's index")
        return super().find_class(module, name)


def check_sharded_metadata(path: str) -> None:
    """Read every `.metadata` index under the checkpoint `path` with only the index's own classes allowed;
    pickle.UnpicklingError names the first thing that is not one of them."""
    for folder, _, files in os.walk(path):
        if ".metadata" in files:
            with open(os.path.join(folder, ".metadata"), "rb") as f:
                _ShardedMetadataUnpickler(f).load()


def _write_own_state(folder: str, state: TrainerState, scheduler) -> None:
    """Deriv's own state is JSON, never pickled: a checkpoint folder someone hands you cannot run code when
    you resume from it. The marker goes last, after an fsync: the bytes are on disk before it says so."""
    with open(os.path.join(folder, STATE_FILE), "w") as f:
        json.dump(state.state_dict(), f)
    with open(os.path.join(folder, SCHEDULER_FILE), "w") as f:
        json.dump(scheduler.state_dict(), f)
    fsync_tree(folder)
    with open(os.path.join(folder, COMPLETE), "w") as f:
        f.write(f"step {state.step}\n")
        f.flush()
        os.fsync(f.fileno())
