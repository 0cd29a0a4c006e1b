"""What the launcher asked for, and what the processes got: the distributed modes on a machine without GPUs.

accelerate picks its mode from the environment `accelerate launch` (or torchrun) sets. Two of its choices
do not match what a CPU run was asked for, and this file settles both, once, before anything is prepared:

- **FSDP on CPU.** `accelerate launch --use_fsdp` (or a config with `distributed_type: FSDP`) on CPU
  processes comes up as plain data parallelism: accelerate enables its FSDP plugin only for accelerator
  backends (`AcceleratorState`, `MULTI_GPU` and its kin). torch's FSDP2 (`fully_shard`) itself runs on CPU
  over gloo, so here the plugin the launcher configured is handed to the state as accelerate does on a GPU.
  Everything after that is accelerate's own FSDP path: wrapping, sharded checkpoints, gathering the weights.
- **DeepSpeed on CPU.** Under `--cpu` accelerate does not set DeepSpeed up at all. Without it, on a machine
  with no GPU (accelerate 1.15, DeepSpeed 0.19.8 on its CPU accelerator, 2026-11-26), each of the launched
  processes comes up as a DeepSpeed run of ONE process, rank 0, though torch's gloo group has them all: every
  process would act as the main one (write the folder, the checkpoints, the export). Both cases stop here with
  one line instead of training in a mode nobody asked for.
"""

from __future__ import annotations

import os

from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

from ..errors import UsageError


def _asked(name: str) -> bool:
    return os.environ.get(f"ACCELERATE_USE_{name}", "false").lower() == "true"


def settle_distributed_mode(accelerator) -> None:
    """Make `accelerator` run the mode the launcher asked for, or say in one line why it cannot."""
    if _asked("FSDP") and accelerator.distributed_type == DistributedType.MULTI_CPU:
        # As AcceleratorState does for GPUs (and mirrors into PartialState, which every later AcceleratorState()
        # copies from): the plugin reads the launcher's FSDP_* variables.
        plugin = FullyShardedDataParallelPlugin()
        if getattr(plugin, "fsdp_version", 1) != 2:
            raise UsageError(
                "FSDP on CPU processes needs FSDP2 (fully_shard; `fsdp_version: 2` in the accelerate config), which "
                f"this accelerate ({accelerate_version()}) does not offer or was not asked for; use an accelerate "
                "with FSDP2 or cpu_two_processes.yaml (DDP)."
            )
        accelerator.state.fsdp_plugin = plugin
        accelerator.state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if _asked("DEEPSPEED") and (
        accelerator.distributed_type != DistributedType.DEEPSPEED or accelerator.num_processes != launched
    ):
        raise UsageError(
            f"DeepSpeed was asked for with {launched} process(es); accelerate set up "
            f"{accelerator.distributed_type.value} with {accelerator.num_processes} on {accelerator.device}. "
            "accelerate runs DeepSpeed on GPUs (and other accelerators), not on CPU processes: on CPU use "
            "training/accelerate_configs/cpu_fsdp.yaml (sharded) or cpu_two_processes.yaml (DDP)."
        )


def check_optimizer_mode(optimizer: str, accelerator) -> None:
    """Muon under a sharding mode: refused before the run starts, in one line.

    subtle: FSDP2 shards each parameter along its first dimension (DeepSpeed's ZeRO flattens and splits them),
    so a process steps only its rows of a matrix; Muon's Newton-Schulz step orthogonalises the whole matrix, and
    on a shard it would compute another update, silently. Under DDP every process holds the whole matrix and
    the all-reduced gradient, and steps it alike. What the launcher asked for counts too (`ACCELERATE_USE_*`):
    one process asked for FSDP is refused as the same command on two would be."""
    if optimizer != "muon":
        return
    mode = accelerator.distributed_type
    for name, wanted in (("FSDP", DistributedType.FSDP), ("DeepSpeed", DistributedType.DEEPSPEED)):
        if mode == wanted or _asked(name.upper()):
            raise UsageError(
                f"--optimizer muon does not run under {name}: it shards each weight matrix across the processes, "
                "and Muon's Newton-Schulz step needs the whole matrix; launch with DDP (cpu_two_processes.yaml, "
                "ddp.yaml) or use --optimizer adamw"
            )


def accelerate_version() -> str:
    import accelerate

    return accelerate.__version__


def fsdp2_available() -> bool:
    """Whether the installed accelerate offers FSDP2 (its plugin has `fsdp_version`)."""
    return "fsdp_version" in FullyShardedDataParallelPlugin.__dataclass_fields__


def describe(accelerator) -> str:
    """'2 process(es) on cpu, FSDP (version 2)': what the log and the run record say about the run's mode."""
    mode = accelerator.distributed_type
    text = f"{accelerator.num_processes} process(es) on {accelerator.device}"
    if mode == DistributedType.FSDP:
        return f"{text}, FSDP (version {getattr(accelerator.state.fsdp_plugin, 'fsdp_version', 1)})"
    if mode in (DistributedType.NO,):
        return text
    return f"{text}, {mode.value}"


def whole_model(model_class, config, state_dict):
    """A plain, unsharded copy of an FSDP-trained model from its gathered weights (`get_state_dict`), for the
    main process's work after training: generation defaults, BLEU, samples, the export (which saves its tied
    weights once, as they share storage here and not in the gathered dict)."""
    model = model_class(config)
    model.load_state_dict(state_dict)
    return model


def one_module_per_tied_embedding(model) -> None:
    """Under FSDP, make each side of an encoder-decoder use the `shared` embedding module itself.

    subtle: accelerate's FSDP2 puts the input embedding, the final norm and the output projection in one group
    when the embedding is tied, and torch >= 2.13 refuses a Parameter that two groups hold. The encoder-decoder
    keeps an embedding module per side over the one shared matrix (BART's way, so that loading reports a missing
    embedding); the decoder's module would stay in the root group with the same Parameter. One module under
    three names is the same matrix and the same state-dict names, and one group holds it.
    """
    inner = getattr(model, "model", None)
    shared = getattr(inner, "shared", None)
    if shared is None:
        return
    for side in (inner.encoder, inner.decoder):
        if side.embed_tokens.weight is shared.weight:
            side.embed_tokens = shared
