"""What an exported model folder holds, read from its files alone (the contract of DESIGN.md).

Nothing here imports the training room or the models: a card, a dry run and a check are made from
`config.json`, `run.json` and the other files, the way a Hub user would see them.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass


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
