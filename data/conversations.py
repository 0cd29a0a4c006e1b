"""Conversations for chat fine-tuning: local JSONL, a `datasets` dataset, or the embedded synthetic default.

A conversation is a list of messages, each `{"role": "system" | "user" | "assistant", "content": str}`: the
`messages` column of the Hub's chat datasets (one JSON object per line in a local .jsonl file). Every
conversation is checked before anything is trained on it, and a bad one is named by file and line (or row).

The embedded default is synthetic: questions made from names in the standard library and the `help()` topics,
answered with the first paragraph of their own docstring or topic text. The sources are parsed with `ast`, never
imported, and the set is the same on every run of the same Python.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import platform
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import MissingFile, MissingKey, UsageError
from .corpus import _SKIPPED_DIRS, load_hub_dataset


ROLES = ("system", "user", "assistant")
DEFAULT_SYSTEM = "You answer questions about Python and its standard library."
# The phrasings of a default question, chosen per name by a hash of it (the same on every run).
QUESTIONS = (
    "What does {name} do?",
    "What is {name} for?",
    "Explain {name}.",
    "Tell me about {name}.",
    "What is {name} in Python?",
)


@dataclass(frozen=True)
class Conversations:
    description: str  # what was read, in words (no absolute paths)
    rows: tuple[tuple[dict, ...], ...]  # the conversations, each checked by `check_messages`
    synthetic: bool = False  # made up from other text, not written by people (the card says so)


def check_messages(messages, where: str) -> tuple[dict, ...]:
    """`messages` as a tuple of {"role", "content"} dicts; ValueError naming `where` and the fault otherwise."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise UsageError(f"{where}: `messages` must be a non-empty list of messages, got {messages!r:.80}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise UsageError(f"{where}: message {i} must be an object with `role` and `content`, got {message!r:.80}")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise UsageError(f"{where}: message {i} has role {role!r}; use one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise UsageError(f"{where}: message {i} ({role}) has content {content!r:.80}; it must be text")
        checked.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" and m["content"].strip() for m in checked):
        raise UsageError(f"{where}: no assistant message with text, so nothing to learn from it")
    return tuple(checked)


def _jsonl_rows(path: str, column: str) -> Iterator[tuple[dict, ...]]:
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}, line {number}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as error:
                    raise UsageError(f"{where}: not valid JSON ({error.msg})") from error
                if not isinstance(row, dict) or column not in row:
                    keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                    raise MissingKey(f"{where}: no {column!r} field (found {keys}); pass --messages-column")
                yield check_messages(row[column], where)
    except UnicodeDecodeError as error:
        raise UsageError(f"{path}: not valid UTF-8 at byte {error.start}; convert the file to UTF-8") from error


def local_conversations(paths: list[str], column: str = "messages") -> Conversations:
    """The `column` of each line of local .jsonl files (folders are searched for *.jsonl)."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names if f.endswith(".jsonl"))
        elif not os.path.exists(path):
            raise MissingFile(f"No such file or folder: {path}")
        elif not path.endswith(".jsonl"):
            raise UsageError(f"{path}: conversations are read from .jsonl files (one `{column}` list per line)")
        else:
            files.append(path)
    if not files:
        raise MissingFile(f"No .jsonl files in {', '.join(paths)}")
    rows = tuple(row for path in files for row in _jsonl_rows(path, column))
    return Conversations(f"local: {len(files)} file(s) from {paths}", rows)


def hub_conversations(name: str, config: str | None, split: str, column: str = "messages") -> Conversations:
    """The `column` of a `datasets` dataset (a local folder, or a name on the Hub)."""
    dataset = load_hub_dataset(name, config, split)
    if column not in dataset.column_names:
        raise MissingKey(f"Dataset {name!r} has no column {column!r}; the columns are {dataset.column_names}")
    rows = tuple(check_messages(m, f"{name} [{split}] row {i}") for i, m in enumerate(dataset[column]))
    return Conversations(f"datasets: {name}{'/' + config if config else ''} [{split}] column {column!r}", rows)


# ---- the embedded synthetic default ------------------------------------------------------------------------


def first_paragraph(text: str, limit: int = 400) -> str:
    """The text up to its first blank line, on one line, cut at the last sentence end within `limit` characters."""
    paragraph = " ".join(text.strip().split("\n\n")[0].split())
    if len(paragraph) <= limit:
        return paragraph
    cut = paragraph[:limit]
    end = cut.rfind(". ")
    return cut[: end + 1] if end > 0 else ""


def _pick(name: str, choices: tuple[str, ...]) -> str:
    return choices[int(hashlib.sha256(name.encode()).hexdigest(), 16) % len(choices)]


def _stdlib_answers() -> Iterator[tuple[str, str]]:
    """(`qualified.name`, first paragraph of its docstring) for the public functions and classes of the standard
    library's public pure-Python modules, in sorted path order."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS and not d.startswith((".", "_")))
        paths += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py") and not f.startswith("_")]
        paths += [os.path.join(dirpath, f) for f in filenames if f == "__init__.py"]  # the package itself
    for path in sorted(paths):
        module = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), filename=path)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node, name in _public_definitions(tree, module):
            answer = first_paragraph(ast.get_docstring(node) or "")
            if len(answer) >= 30:
                yield f"`{name}`", answer


def _public_definitions(tree: ast.Module, module: str) -> Iterator[tuple[ast.AST, str]]:
    """The module's public functions and classes, and the public methods of those classes, by qualified name."""
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and not node.name.startswith("_"):
            yield node, f"{module}.{node.name}"
            if isinstance(node, ast.ClassDef):
                for method in node.body:
                    if isinstance(method, ast.FunctionDef) and not method.name.startswith("_"):
                        yield method, f"{module}.{node.name}.{method.name}"


def _topic_answers() -> Iterator[tuple[str, str]]:
    """(title, first paragraph) of each `help()` topic: 'the "assert" statement' and what follows its rule."""
    from pydoc_data.topics import topics

    for key in sorted(topics):
        lines = topics[key].strip().split("\n")
        if len(lines) > 2 and set(lines[1]) <= set("*=-") and lines[1]:
            answer = first_paragraph("\n".join(lines[2:]))
            if len(answer) >= 30:
                title = lines[0].strip()
                yield (title[0].lower() + title[1:] if title[:1].isupper() else title), answer


@functools.lru_cache(maxsize=1)
def _default_rows() -> tuple[tuple[dict, ...], ...]:
    answers = [*_topic_answers(), *_stdlib_answers()]
    rows = []
    for i, (name, answer) in enumerate(answers):
        turns = [{"role": "user", "content": _pick(name, QUESTIONS).format(name=name)}]
        turns.append({"role": "assistant", "content": answer})
        if i % 4 == 3:  # every fourth conversation goes on: a second question, about the name before it
            other, other_answer = answers[i - 1]
            turns += [
                {"role": "user", "content": _pick(other, QUESTIONS).format(name=other)},
                {"role": "assistant", "content": other_answer},
            ]
        if i % 3 == 0:  # a third of them open with a system message
            turns.insert(0, {"role": "system", "content": DEFAULT_SYSTEM})
        rows.append(tuple(turns))
    return tuple(rows)


def default_conversations() -> Conversations:
    """Synthetic question-and-answer conversations from text that ships with every CPython (no network)."""
    return Conversations(
        f"default (synthetic): questions on Python {platform.python_version()}'s help() topics and standard "
        "library names, answered with the first paragraph of their own text",
        _default_rows(),
        synthetic=True,
    )
