"""What an exported model folder holds (the contract of DESIGN.md), and the one way to open it.

A card, a dry run and a check are made from `config.json`, `run.json` and the other files alone, the way a
Hub user would see them. `load_folder` opens the model itself, for every command and room that runs one;
`load_weights` is the one `from_pretrained` under it (and under import, export, quantize and --init-from), and
the promise of both: weights are read from safetensors only (a pickle is never opened: unpickling can run
code), and a checkpoint that lacks a tensor the model needs, holds one of the wrong shape, or holds tensors the
model has no place for is refused, never filled in with random values. Nothing here imports the training room.
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..errors import MissingFile, UsageError
from .inside import OutsideFolder, check_inside, entry_problem, files_inside, is_regular_inside, read_bytes_inside
from .remote_code import check_tokenizer_code


# Folders and files an export keeps for training or resuming, never uploaded: optimizer states, the
# tokenizer's training copy, caches.
IGNORED = ("checkpoints/*", "tokenizer/*", ".*", "__pycache__/*", "*.pyc")

# The model types of DerivConfig and DerivSeq2SeqConfig: what a command that runs Deriv's models loads without
# --trust-remote-code (tests/test_load_paths.py checks this against the config classes).
DERIV_MODEL_TYPES = ("deriv", "deriv_seq2seq")
# The native types `deriv import` turns into Deriv folders; a folder of one is pointed there.
IMPORTABLE_MODEL_TYPES = ("gpt2", "llama", "marian")
SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
# Weight files `torch.load` would unpickle: PyTorch's, and the names other tools give their pickles.
PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


@dataclass
class ModelFolder:
    path: str
    config: dict
    run: dict | None  # run.json, or None for a folder made without the training commands
    generation: dict | None

    @property
    def is_seq2seq(self) -> bool:
        return bool(self.config.get("is_encoder_decoder"))

    @property
    def pipeline_tag(self) -> str:
        return "translation" if self.is_seq2seq else "text-generation"

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def has(self, name: str) -> bool:
        """Whether the folder holds `name` as a regular file inside it (a link out or a FIFO is not held)."""
        return is_regular_inside(self.path, name)


def read_json(folder: str | os.PathLike, name: str, object_pairs_hook=None) -> dict:
    """The JSON object in `folder/name`, read the one way every JSON file of a folder is read: a regular file
    inside the folder (a link out, a FIFO or a device is refused by name, unopened: `read_bytes_inside`), UTF-8,
    valid JSON, an object; otherwise one UsageError naming the file.

    subtle: Python's json parser recurses once per nested object or list, so `[[[[...]]]]` 100,000 deep raises
    RecursionError; that is the file's fault, and refused as such."""
    path = os.path.join(str(folder), name)
    data = read_bytes_inside(folder, name)
    try:
        value = json.loads(data.decode("utf-8"), object_pairs_hook=object_pairs_hook)
    except UnicodeDecodeError as error:
        raise UsageError(f"{path} is not valid JSON: not UTF-8 text (byte {error.start})") from error
    except json.JSONDecodeError as error:
        raise UsageError(f"{path} is not valid JSON: {error}") from error
    except RecursionError:  # from None: a thousand frames of the parser say nothing more
        raise UsageError(f"{path} is nested too deeply (objects or lists within each other) to be read") from None
    if not isinstance(value, dict):
        raise UsageError(f"{path} should hold a JSON object")
    return value


def _optional_json(folder: str, name: str) -> dict | None:
    """`read_json(folder, name)`, or None when there is no such entry at all (a dangling link is refused)."""
    return read_json(folder, name) if os.path.lexists(os.path.join(folder, name)) else None


def read_folder(path: str | os.PathLike) -> ModelFolder:
    """The folder's config, run record and generation defaults; a clear error if it is no model folder, or if one
    of those files is not a regular file inside it (`folder/inside.py`)."""
    path = str(path)
    if not os.path.isdir(path):
        raise MissingFile(f"No such folder: {path}")
    if not os.path.lexists(os.path.join(path, "config.json")):
        raise MissingFile(f"{path} is not a model folder: it has no config.json")
    config = read_json(path, "config.json")
    return ModelFolder(path, config, _optional_json(path, "run.json"), _optional_json(path, "generation_config.json"))


def _ignored(rel: str) -> bool:
    """Whether an upload leaves `rel` out and a load never reads it (IGNORED: checkpoints/, tokenizer/, ...)."""
    from fnmatch import fnmatch

    return any(fnmatch(rel, pattern) for pattern in IGNORED)


def checked_files(folder: str | os.PathLike) -> list[tuple[str, int]]:
    """(relative path, bytes) of every file of a local folder that a load may read and an upload sends (all but
    IGNORED), once each is known to be a regular file inside the folder; otherwise OutsideFolder naming every
    entry that is not (a link out, a dangling link, a folder linked in, a FIFO, a socket, a device).

    subtle: transformers reads whatever files of the folder it looks for (tokenizer files, chat templates,
    `additional_chat_templates/`, an adapter, the shards an index names), and `upload_folder` sends what links
    point to; so the rule holds for the whole folder, not for a list of names, before either opens anything."""
    return files_inside(folder, skip=_ignored)


@dataclass
class LoadedFolder:
    """An exported folder, opened: the model (in eval mode), its tokenizer and configs, and the run record."""

    path: str
    model: Any
    tokenizer: Any
    config: Any  # the model's PretrainedConfig
    record: dict | None  # run.json, or None when the folder has none (or is a Hub name, not a local folder)

    @property
    def generation_config(self):
        return self.model.generation_config


def _cause(error: BaseException) -> str:
    """An error's message on one line (a KeyError's key without the quotes `str` adds)."""
    text = error.args[0] if isinstance(error, KeyError) and error.args else error
    return " ".join(str(text).split()) or type(error).__name__


def load_folder(path: str | os.PathLike, seq2seq: bool | None = None, trust_remote_code: bool = False) -> LoadedFolder:
    """Open an exported folder (or a Hub name): `seq2seq=True` wants a translation model, `False` a language
    model, `None` takes whichever kind the folder holds. Bad input raises UsageError (MissingFile for a folder
    that is not there) with one message naming the folder and the cause.

    Only Deriv's model types load (`DERIV_MODEL_TYPES`), through the installed classes (registered with the Auto
    classes when `deriv_lm` is imported), so a folder's copied `.py` files never run. A folder of another type
    is refused unless `trust_remote_code`, the user's own consent, which lets it run its own code. Either way
    the weights go through `load_weights`: safetensors only, every tensor present and of its shape.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    folder = str(path)
    local = os.path.isdir(folder)
    if not local and (os.path.exists(folder) or os.path.isabs(folder) or folder.startswith(".")):
        raise MissingFile(f"{folder}: no such model folder")
    if local:  # every entry a load may read is a regular file inside the folder; then the type as config.json says
        checked_files(folder)  # it, before any class (or code) is chosen by it
        check_model_type(folder, read_folder(folder).config.get("model_type"), trust_remote_code=trust_remote_code)
        check_tokenizer_code(folder, trust_remote_code)  # a tokenizer of its own code: refused, not replaced

    def unloadable(error: Exception) -> UsageError:  # a corrupt or foreign folder fails in many ways
        hint = "" if trust_remote_code else "; if it is not Deriv's and you trust its code, pass --trust-remote-code"
        return UsageError(f"{folder}: not a model folder this command can load ({_cause(error)}){hint}")

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        is_seq2seq = bool(config.is_encoder_decoder)
    except Exception as error:
        raise unloadable(error) from error
    if not local:
        check_model_type(folder, config.model_type, trust_remote_code=trust_remote_code)
    if seq2seq is not None and is_seq2seq != seq2seq:
        wanted, found = ("translation", "language") if seq2seq else ("language", "translation")
        raise UsageError(f"{folder} holds a {found} model; this command needs a {wanted} model")
    auto = AutoModelForSeq2SeqLM if is_seq2seq else AutoModelForCausalLM
    model = load_weights(auto, folder, config=config, trust_remote_code=trust_remote_code).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as error:
        raise unloadable(error) from error
    if local and os.path.isfile(os.path.join(folder, ADAPTER, "adapter_config.json")):
        model = with_adapter(model, folder)
    record = _optional_json(folder, "run.json") if local else None
    return LoadedFolder(folder, model, tokenizer, config, record)


def check_model_type(
    folder: str | os.PathLike,
    found: str | None,
    expected: tuple[str, ...] = DERIV_MODEL_TYPES,
    trust_remote_code: bool = False,
    consent: str | None = "--trust-remote-code",
) -> None:
    """Raise ValueError unless `found` (a folder's model_type) is one of `expected`, or the user consented to
    another with `trust_remote_code`; `consent` is the flag the message offers for that (None: the command has
    none). Without the check a foreign config builds a model of another architecture, or a Deriv model of the
    default shape, and runs it on whatever weights fit."""
    if found in expected or trust_remote_code:
        return
    if not found:
        raise UsageError(f"{folder}/config.json has no model_type; it is not a model folder this command can load")
    hints = []
    if found in IMPORTABLE_MODEL_TYPES and expected == DERIV_MODEL_TYPES:
        hints.append(f"`deriv import` converts a {found} folder into a Deriv one")
    if consent:
        hints.append(f"if you trust its code, pass {consent}")
    names = " or ".join(repr(t) for t in expected)
    wanted = f"a Deriv one (type {names})" if expected == DERIV_MODEL_TYPES else f"one of type {names}"
    raise UsageError(f"{folder} holds a {found!r} model, not {wanted}" + "".join(f"; {h}" for h in hints))


def check_weight_files(folder: str | os.PathLike) -> None:
    """Raise unless a local folder keeps its weights in safetensors, whole: a folder with only a pickle
    (`pytorch_model.bin`, ...) is refused with how to convert it, without the pickle being opened, and every
    `*.safetensors` file must be as long as its header says (`check_safetensors`). A Hub name is left to
    `from_pretrained(use_safetensors=True)`, which refuses a repository without safetensors."""
    folder = str(folder)
    if not os.path.isdir(folder):
        return
    checked_files(folder)  # no link out, no FIFO among what the load reads
    names = set(os.listdir(folder))
    if SAFETENSORS[1] in names and SAFETENSORS[0] not in names:
        check_shard_index(folder)
    if not names.intersection(SAFETENSORS):
        pickles = sorted(n for n in names if n.endswith(PICKLED) and os.path.isfile(os.path.join(folder, n)))
        if not pickles:
            raise MissingFile(f"{folder} has no model.safetensors (the weights)")
        try:
            seq2seq = bool(read_folder(folder).config.get("is_encoder_decoder"))
        except (OSError, ValueError):
            seq2seq = False
        auto = "AutoModelForSeq2SeqLM" if seq2seq else "AutoModelForCausalLM"
        raise UsageError(
            f"{folder} has its weights only as a pickle ({', '.join(pickles)}), which deriv never opens (unpickling "
            f"can run code); convert it once, in a Python you trust it in: `{auto}.from_pretrained(folder)` then "
            "`.save_pretrained(folder)` writes model.safetensors"
        )
    check_safetensors(folder)


def check_shard_index(folder: str | os.PathLike) -> dict[str, str]:
    """The `weight_map` (tensor -> shard file) of a sharded folder's `model.safetensors.index.json`, once it is
    known that loading through it reads safetensors inside the folder and nothing else; otherwise one UsageError
    naming the index and the entry, before any shard is opened.

    subtle: transformers joins each name in the index to the folder and loads what it finds there, whatever the
    name: `weights.bin` (a pickle), `../other/model.safetensors`, an absolute path, a link out of the folder.
    So each name must be a plain `.safetensors` file name inside the folder (no `..`, no absolute path, no
    symbolic link that leads out, no FIFO, no NUL), present, and each tensor named once. The index itself is read
    as every JSON file of a folder is (`read_json`: no link out, no FIFO, not nested past the parser), and must
    hold the `metadata` object transformers reads beside the map. Whether the shards hold every tensor the model
    needs, at its shape, is `load_weights`' check after."""
    folder = str(folder)
    index = os.path.join(folder, SAFETENSORS[1])
    duplicated: list[str] = []

    def unique(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                duplicated.append(key)
            seen[key] = value
        return seen

    value = read_json(folder, SAFETENSORS[1], object_pairs_hook=unique)
    weight_map = value.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise UsageError(f"{index} has no weight_map (tensor name -> shard file)")
    if not isinstance(value.get("metadata"), dict):  # transformers reads index["metadata"]: a KeyError without it
        raise UsageError(f'{index} has no "metadata" object (transformers reads it beside the weight_map)')
    if duplicated:
        raise UsageError(f"{index} names {_count(duplicated, 'tensor')} more than once: {_some(sorted(duplicated))}")
    for tensor, name in weight_map.items():
        _check_shard_name(index, folder, tensor, name)
    _check_shard_headers(index, folder, weight_map)
    return weight_map


def _check_shard_name(index: str, folder: str, tensor: str, name) -> None:
    """One UsageError unless `name`, the shard the index puts `tensor` in, is a safetensors file inside `folder`."""
    if not isinstance(name, str) or not name:
        raise UsageError(f"{index}: {tensor!r} names no shard file")
    where = f"{index}: {tensor!r} is in {name!r}"
    if os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        raise UsageError(f"{where}, a path outside the folder; a shard is a file of the folder itself")
    if not name.endswith(".safetensors"):
        raise UsageError(
            f"{where}, which is not a safetensors file; deriv reads weights from safetensors only (a pickle "
            "is never opened: unpickling can run code)"
        )
    why = entry_problem(folder, name)
    if why:
        raise OutsideFolder(f"{where}, which {why}; a shard is a regular file of the folder itself")
    if not os.path.isfile(os.path.join(folder, name)):
        raise MissingFile(f"{where}, which is not there")


def _check_shard_headers(index: str, folder: str, weight_map: dict[str, str]) -> None:
    """Each tensor in exactly one shard, the one the index names, and no shard tensor the index leaves out (the
    library would take it, or the later of two copies, without a word). Reads the shards' headers only."""
    from safetensors import SafetensorError, safe_open

    held: dict[str, list[str]] = {}
    for shard in sorted(set(weight_map.values())):
        try:
            with safe_open(os.path.join(folder, shard), framework="pt") as f:
                keys = list(f.keys())
        except SafetensorError as error:
            raise UsageError(f"{os.path.join(folder, shard)}: not a whole safetensors file ({error})") from error
        for key in keys:
            held.setdefault(key, []).append(shard)
    twice = sorted(f"{k} ({', '.join(v)})" for k, v in held.items() if len(v) > 1)
    if twice:
        raise UsageError(f"{index}: {_count(twice, 'tensor')} in more than one shard: {_some(twice)}")
    misplaced = sorted(f"{k} (not in {shard})" for k, shard in weight_map.items() if held.get(k) != [shard])
    if misplaced:
        raise UsageError(f"{index} names {_count(misplaced, 'tensor')} where they are not: {_some(misplaced)}")
    unnamed = sorted(k for k in held if k not in weight_map)
    if unnamed:
        raise UsageError(f"{index} leaves out {_count(unnamed, 'tensor')} its shards hold: {_some(unnamed)}")


def load_weights(model_class, folder: str | os.PathLike, **kwargs):
    """`model_class.from_pretrained(folder, **kwargs)` that reads safetensors only and invents no weight.

    Raises ValueError (one line, naming the file, folder or tensors) for a pickle-only folder, a torn or
    unreadable safetensors file, a tensor the model needs that the checkpoint lacks (the library would draw it
    at random), one of another shape, or tensors the model has no place for (the config and the weights
    describe different models: a layer count lowered in config.json would silently drop layers). Tied weights
    (the output projection that is the embedding) are not missing: the library re-ties them, and reports only
    what it could not fill. Names the library itself ignores (`_keys_to_ignore_on_load_*`) stay ignored.
    """
    from safetensors import SafetensorError

    check_weight_files(folder)
    weights = _weights_name(folder)
    if kwargs.get("quantization_config") is not None and os.path.isdir(folder):
        _refuse_misfit(weights, mismatched=_misshapen_before_quantizing(model_class, folder, kwargs.get("config")))
    with _held_load_report() as release:
        try:
            model, info = model_class.from_pretrained(
                str(folder), use_safetensors=True, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
            )
        except (SafetensorError, RuntimeError, OSError) as error:  # unreadable bytes, a missing shard, ...
            raise UsageError(f"{weights}: the weights cannot be read ({_cause(error)})") from error
        except ValueError as error:  # the model's own check of its config (GPT-2's n_embd % n_head, ...)
            where = os.path.join(str(folder), "config.json") if os.path.isdir(folder) else str(folder)
            raise UsageError(f"{where} describes a model that cannot be built: {_cause(error)}") from error
        _refuse_misfit(weights, info["missing_keys"], info["mismatched_keys"], info["unexpected_keys"])
        release()
    return model


def _refuse_misfit(weights: str, missing=(), mismatched=(), unexpected=()) -> None:
    """One ValueError naming what of the checkpoint `weights` does not fit its model, if anything."""
    missing, unexpected = sorted(missing), sorted(unexpected)
    problems = []
    if missing:
        problems.append(f"missing {_count(missing, 'tensor')} the model needs: {_some(missing)}")
    if mismatched:
        shapes = [f"{k} {tuple(found)} where the model has {tuple(want)}" for k, found, want in sorted(mismatched)]
        problems.append(f"{_count(shapes, 'tensor')} of the wrong shape: {_some(shapes)}")
    if unexpected:
        problems.append(f"{_count(unexpected, 'tensor')} the model has no place for: {_some(unexpected)}")
    if problems:
        raise UsageError(f"{weights} does not fit the model its config.json describes: {'; '.join(problems)}")


def _misshapen_before_quantizing(model_class, folder: str | os.PathLike, config=None) -> list[tuple]:
    """(name, shape in the file, shape in the model) of each stored tensor whose shape is not the model's.

    subtle: a quantized load (torchao's, `deriv quantize`) puts each checkpoint tensor in its layer as it comes,
    whatever its shape, and reports no mismatch; so the headers are compared first with the float model the
    config describes, built on the meta device (no memory is allocated, no weight drawn). Names that are not the
    model's are left to the load's own report.
    """
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig

    config = config if config is not None else AutoConfig.from_pretrained(str(folder))
    with torch.device("meta"):
        model = model_class.from_config(config) if hasattr(model_class, "from_config") else model_class(config)
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    wrong = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                for key in f.keys():
                    shape = tuple(f.get_slice(key).get_shape())
                    if key in expected and shape != expected[key]:
                        wrong.append((key, shape, expected[key]))
    return wrong


def _weights_name(folder: str | os.PathLike) -> str:
    """The weights file a message names: the folder's model.safetensors (or its shard index), or the folder."""
    for name in SAFETENSORS:
        if os.path.isfile(os.path.join(folder, name)):
            return os.path.join(str(folder), name)
    return str(folder)


def _count(items: list, noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def _some(names: list[str], shown: int = 5) -> str:
    """The first `shown` names, and how many more: `a, b, c (and 31 more)`."""
    more = f" (and {len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


@contextmanager
def _held_load_report():
    """Hold back what transformers logs while a model loads, and let it out only when `release()` is called.

    subtle: `from_pretrained` logs a many-line LOAD REPORT (missing, unexpected and mismatched tensors) and
    tie warnings before it returns or raises. `load_weights` turns each of those findings into its one-line
    refusal, so on a refusal they are dropped; on a load that passes they are logged as they would have been.
    """
    logger = logging.getLogger("transformers.modeling_utils")
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        held.append(record)
        return False

    released = []
    logger.addFilter(hold)
    try:
        yield lambda: released.append(True)
    finally:
        logger.removeFilter(hold)
        if released:
            for record in held:
                logger.handle(record)


ADAPTER = "adapter"  # where `deriv train sft --lora --lora-export adapter` puts the LoRA adapter, beside its base


def with_adapter(model, folder: str):
    """The folder's base `model` with its LoRA adapter (FOLDER/adapter) merged in, through PEFT. Only a
    safetensors adapter is read: PEFT would unpickle an `adapter_model.bin`, which may run code."""
    adapter = os.path.join(folder, ADAPTER)
    if not os.path.isfile(os.path.join(adapter, "adapter_model.safetensors")):
        raise UsageError(f"{adapter} has no adapter_model.safetensors; only a safetensors adapter is loaded")
    try:
        from peft import PeftModel
    except ImportError as error:
        raise UsageError(
            f"{folder} holds a LoRA adapter ({ADAPTER}/) beside its base weights; loading it needs PEFT: "
            "pip install 'deriv-lm[lora]'"
        ) from error
    from ..modeling_deriv.lora_targets import quiet_peft_deprecations

    try:
        with quiet_peft_deprecations():
            return PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
    except Exception as error:
        raise UsageError(f"{adapter}: not a LoRA adapter for this model ({_cause(error)})") from error


def code_files(folder: ModelFolder) -> list[str]:
    """The Python files `trust_remote_code` loading needs: the modules `auto_map` and `custom_pipelines` name,
    and the sibling modules those import (`from .configuration_deriv import ...`), transitively.

    Each file's imports are read by transformers' own parser (`get_relative_imports`, what `from_pretrained`
    fetches by); the walk is ours because the library's (`get_relative_import_files`) stops at a sibling that is
    missing, which `missing_files` must name instead."""
    from transformers.dynamic_module_utils import get_relative_imports

    modules = [ref.split(".")[0] for ref in (folder.config.get("auto_map") or {}).values() if isinstance(ref, str)]
    for task in (folder.config.get("custom_pipelines") or {}).values():
        modules.append(task["impl"].split(".")[0])
    needed: list[str] = []
    while modules:
        name = modules.pop(0) + ".py"
        if name in needed:
            continue
        needed.append(name)
        if folder.has(name):
            modules += sorted(get_relative_imports(folder.file(name)))  # subtle: the library returns a set's order
    return needed


# The files a tokenizer keeps its vocabulary in: the fast one's, or the SentencePiece models a slow one reads
# (OPUS-MT's MarianTokenizer: source.spm and target.spm, no fast twin; T5's spiece.model; Llama's tokenizer.model).
TOKENIZER_FILES = ("tokenizer.json", "source.spm", "spiece.model", "tokenizer.model", "sentencepiece.bpe.model")


def tokenizer_file(path: str | os.PathLike) -> str | None:
    """The file of `TOKENIZER_FILES` the folder holds (its vocabulary), or None when it has no tokenizer."""
    return next((name for name in TOKENIZER_FILES if is_regular_inside(path, name)), None)


def missing_files(folder: ModelFolder) -> list[str]:
    """Problems that would stop a Hub user, each naming the file; empty when the folder is complete."""
    problems = []
    if not folder.config.get("auto_map"):
        problems.append("config.json has no auto_map: users without this package could not load the model")
    has_weights = folder.has("model.safetensors") or folder.has("model.safetensors.index.json")
    if not has_weights:
        problems.append("model.safetensors is missing (the weights)")
    for name, what in (
        ("generation_config.json", "the generation defaults"),
        (tokenizer_file(folder.path) or "tokenizer.json", "the tokenizer"),
        ("tokenizer_config.json", "the tokenizer's settings"),
        ("README.md", "the model card; write it with `deriv card FOLDER`"),
    ):
        if not folder.has(name):
            problems.append(f"{name} is missing ({what})")
    for name in code_files(folder):
        if not folder.has(name):
            problems.append(f"{name} is missing (model or pipeline code that config.json names)")
    return problems


def upload_list(folder: ModelFolder) -> list[tuple[str, int]]:
    """(relative path, bytes) of every file an upload sends, sorted; what IGNORED names is left out. Refuses
    (OutsideFolder, naming each) a link out, a folder linked in, a FIFO, a socket or a device anywhere else in the
    folder: nothing a listing shows is anything but a regular file inside it (`checked_files`)."""
    return checked_files(folder.path)


# What `deriv push` publishes: the kinds of file a model folder is made of (weights in safetensors, configs, the
# tokenizer's files, the chat template, the card and its pictures, the run's records) and, for Python, only this
# package's own code files as installed. Anything else is refused by name: a pickle (whoever loads the repository
# the old way unpickles it, which can run code), a script, a file of code that is not the package's.
PUBLISHABLE = ("*.safetensors", "*.json", "*.jinja", "*.md", "*.txt", "*.spm", "*.model", "*.png", "*.jpg", "*.svg")
PUBLISHABLE += ("metrics.jsonl",)


def unpublishable(folder: ModelFolder, files: list[tuple[str, int]]) -> list[str]:
    """Each file of the upload list that a model folder should not publish, with why (see PUBLISHABLE)."""
    from fnmatch import fnmatch

    from ..modeling_deriv import __file__ as package_init

    own_code = os.path.dirname(package_init)
    found = []
    for rel, _ in files:
        name = os.path.basename(rel)
        if rel.endswith(".py"):
            installed = os.path.join(own_code, name)
            same = os.path.isfile(installed) and "/" not in rel and _same_bytes(installed, folder, rel)
            if not same:
                found.append(f"{rel} (Python that is not this package's own {name}: it would run for every user)")
        elif rel.endswith(PICKLED):
            found.append(f"{rel} (a pickle: loading it can run code)")
        elif not any(fnmatch(rel, pattern) for pattern in PUBLISHABLE):
            found.append(f"{rel} (not a file a model folder holds)")
    return found


def _same_bytes(installed: str, folder: ModelFolder, rel: str) -> bool:
    with open(installed, "rb") as f:
        return f.read() == read_bytes_inside(folder.path, rel)


def check_safetensors(path: str | os.PathLike) -> None:
    """Raise a ValueError (UsageError) naming a `*.safetensors` file of the folder that is not whole.

    safetensors' own `safe_open` reads the header and refuses a file that is too short, whose header is not
    valid, or whose length is not exactly what the header describes: a truncated upload or a torn copy fails
    here, before a Hub user downloads it. Only the header is read (the tensors are mapped, not loaded), and only of
    a regular file inside the folder: a `*.safetensors` that is a link out, a FIFO or a device is refused by name.
    """
    from safetensors import SafetensorError, safe_open

    from ..errors import UsageError

    for name in sorted(os.listdir(path)):
        if not name.endswith(".safetensors"):
            continue
        file = check_inside(path, name, what="weights")  # a link out is not read, a FIFO not opened (it blocks)
        try:
            with safe_open(file, framework="pt"):
                pass
        except SafetensorError as error:
            raise UsageError(
                f"{file}: not a whole safetensors file, truncated, torn or not safetensors ({error})"
            ) from error
