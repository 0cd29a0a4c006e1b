"""What an exported model folder holds (the contract of DESIGN.md), and the one way to open it.

A card, a dry run and a check are made from `config.json`, `run.json` and the other files alone, the way a
Hub user would see them. `load_folder` opens the model itself, for every command and room that runs one.
Nothing here imports the training room.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any


# Folders and files an export keeps for training or resuming, never uploaded: optimizer states, the
# tokenizer's training copy, caches.
IGNORED = ("checkpoints/*", "tokenizer/*", ".*", "__pycache__/*", "*.pyc")
_RELATIVE_IMPORT = re.compile(r"^\s*from\s+\.(\w+)\s+import", re.M)


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
        return os.path.isfile(self.file(name))


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise ValueError(f"{path} should hold a JSON object")
    return value


def read_folder(path: str | os.PathLike) -> ModelFolder:
    """The folder's config, run record and generation defaults; a clear error if it is no model folder."""
    path = str(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"No such folder: {path}")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path} is not a model folder: it has no config.json")
    config = _read_json(config_path)
    run = _read_json(os.path.join(path, "run.json")) if os.path.isfile(os.path.join(path, "run.json")) else None
    gen_path = os.path.join(path, "generation_config.json")
    generation = _read_json(gen_path) if os.path.isfile(gen_path) else None
    return ModelFolder(path, config, run, generation)


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
    model, `None` takes whichever kind the folder holds. Bad input raises FileNotFoundError or ValueError with
    one message naming the folder and the cause.

    Deriv's model types are registered with the Auto classes when `deriv_lm` is imported, so its folders load
    through the installed classes and their copied `.py` files never run; a folder of another type runs its own
    code only with `trust_remote_code`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    folder = str(path)
    local = os.path.isdir(folder)
    if not local and (os.path.exists(folder) or os.path.isabs(folder) or folder.startswith(".")):
        raise FileNotFoundError(f"{folder}: no such model folder")

    def unloadable(error: Exception) -> ValueError:  # a corrupt or foreign folder fails in many ways
        hint = "" if trust_remote_code else "; if it is not Deriv's and you trust its code, pass --trust-remote-code"
        return ValueError(f"{folder}: not a model folder this command can load ({_cause(error)}){hint}")

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        is_seq2seq = bool(config.is_encoder_decoder)
    except Exception as error:
        raise unloadable(error) from error
    if seq2seq is not None and is_seq2seq != seq2seq:
        wanted, found = ("translation", "language") if seq2seq else ("language", "translation")
        raise ValueError(f"{folder} holds a {found} model; this command needs a {wanted} model")
    auto = AutoModelForSeq2SeqLM if is_seq2seq else AutoModelForCausalLM
    try:
        model = auto.from_pretrained(folder, config=config, trust_remote_code=trust_remote_code).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as error:
        raise unloadable(error) from error
    if local and os.path.isfile(os.path.join(folder, ADAPTER, "adapter_config.json")):
        model = with_adapter(model, folder)
    record_path = os.path.join(folder, "run.json")
    record = _read_json(record_path) if local and os.path.isfile(record_path) else None
    return LoadedFolder(folder, model, tokenizer, config, record)


ADAPTER = "adapter"  # where `deriv train sft --lora --lora-export adapter` puts the LoRA adapter, beside its base


def with_adapter(model, folder: str):
    """The folder's base `model` with its LoRA adapter (FOLDER/adapter) merged in, through PEFT. Only a
    safetensors adapter is read: PEFT would unpickle an `adapter_model.bin`, which may run code."""
    adapter = os.path.join(folder, ADAPTER)
    if not os.path.isfile(os.path.join(adapter, "adapter_model.safetensors")):
        raise ValueError(f"{adapter} has no adapter_model.safetensors; only a safetensors adapter is loaded")
    try:
        from peft import PeftModel
    except ImportError as error:
        raise ValueError(
            f"{folder} holds a LoRA adapter ({ADAPTER}/) beside its base weights; loading it needs PEFT: "
            "pip install 'deriv-lm[lora]'"
        ) from error
    from ..modeling_deriv.lora_targets import quiet_peft_deprecations

    try:
        with quiet_peft_deprecations():
            return PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
    except Exception as error:
        raise ValueError(f"{adapter}: not a LoRA adapter for this model ({_cause(error)})") from error


def code_files(folder: ModelFolder) -> list[str]:
    """The Python files `trust_remote_code` loading needs: the modules `auto_map` and `custom_pipelines` name,
    and the sibling modules those import (`from .configuration_deriv import ...`), transitively."""
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
            with open(folder.file(name), encoding="utf-8") as f:
                modules += _RELATIVE_IMPORT.findall(f.read())
    return needed


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
        ("tokenizer.json", "the tokenizer"),
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
    """(relative path, bytes) of every file an upload sends, sorted; what IGNORED names is left out."""
    from fnmatch import fnmatch

    files = []
    for root, dirs, names in os.walk(folder.path):
        dirs.sort()
        for name in sorted(names):
            rel = os.path.relpath(os.path.join(root, name), folder.path).replace(os.sep, "/")
            if not any(fnmatch(rel, pattern) for pattern in IGNORED):
                files.append((rel, os.path.getsize(os.path.join(root, name))))
    return files


def check_safetensors(path: str | os.PathLike) -> None:
    """Raise ValueError naming a `*.safetensors` file of the folder whose header or size is wrong.

    The format is 8 bytes (little-endian header length N), N bytes of JSON {name: {dtype, shape, data_offsets}},
    then the data; a complete file is exactly 8 + N + the largest end offset bytes long. A truncated upload or
    a torn copy fails here, before a Hub user downloads it.
    """
    import struct

    for name in sorted(os.listdir(path)):
        if not name.endswith(".safetensors"):
            continue
        file = os.path.join(path, name)
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{file}: {size} bytes, too short to be a safetensors file")
            (length,) = struct.unpack("<Q", head)
            if 8 + length > size:
                raise ValueError(f"{file}: the header says {length} bytes of metadata but the file has {size} bytes")
            try:
                header = json.loads(f.read(length))
                ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
            except (ValueError, KeyError, TypeError, IndexError) as error:
                raise ValueError(f"{file}: the safetensors header is not valid ({error})") from error
        expected = 8 + length + max(ends, default=0)
        if size != expected:
            raise ValueError(
                f"{file}: {size} bytes, but its header describes {expected}: the file is truncated or torn"
            )
