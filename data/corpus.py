"""Where the text comes from: the embedded default corpus, local files, or a `datasets` dataset.

Every source yields plain strings (documents) and describes itself in one line for the run
records. Errors name the file, column or dataset at fault.
"""

from __future__ import annotations

import argparse
import ast
import functools
import glob
import itertools
import os
import platform
import re
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..errors import MissingFile, MissingKey, UsageError


LOCAL_SUFFIXES = (".txt", ".jsonl", ".json", ".csv", ".parquet")

# Parts of the standard library that are not prose worth learning from (tests, vendored
# grammars, the IDE, demo and platform-specific trees).
_SKIPPED_DIRS = {
    "test",
    "tests",
    "idle_test",
    "idlelib",
    "lib2to3",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "ensurepip",
    "turtledemo",
    "pydoc_data",
    "venv",
    "tkinter",
    "encodings",
}


@dataclass(frozen=True)
class Corpus:
    """A named source of documents that can be read more than once (each `iter` starts again)."""

    description: str
    documents: Callable[[], Iterator[str]]
    files: tuple[str, ...] = ()  # the local files it reads, if any (what a cache must watch)

    def __iter__(self) -> Iterator[str]:
        return self.documents()


def _stdlib_docstrings() -> Iterator[str]:
    """Docstrings of the standard library's pure-Python modules, classes and functions.

    The sources are parsed with `ast`, never imported, so no module runs any code (no
    `antigravity` opening a browser, no `this` printing a poem) and the result does not depend on
    what happens to be importable. Files are read in sorted path order; repeated docstrings are
    kept once.
    """
    root = sysconfig.get_paths()["stdlib"]
    seen: set[str] = set()
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS and not d.startswith("."))
        paths += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    for path in sorted(paths):
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), filename=path)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a handful of files are deliberately broken or in other encodings
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 40 and doc not in seen:
                    seen.add(doc)
                    yield doc


def _pydoc_topics() -> Iterator[str]:
    """The language reference topics that `help()` shows (`pydoc_data.topics`), in sorted key order."""
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield topics[key]


@functools.lru_cache(maxsize=1)
def _default_documents() -> tuple[str, ...]:
    return (*_pydoc_topics(), *_stdlib_docstrings())  # parsing the stdlib takes seconds: do it once


def default_corpus() -> Corpus:
    """English text that ships with every CPython: the `help()` topics and the standard library's docstrings.

    About 2 MB, the same text in the same order on every run of the same Python, and no network.
    """
    return Corpus(
        f"default: Python {platform.python_version()} help() topics + stdlib docstrings",
        lambda: iter(_default_documents()),
    )


def _expand(paths: str | list[str]) -> list[str]:
    """Files named by paths, globs or folders (searched recursively for the known suffixes), sorted."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    files: list[str] = []
    for entry in paths:
        if os.path.isdir(entry):
            for suffix in LOCAL_SUFFIXES:
                files += glob.glob(os.path.join(entry, "**", f"*{suffix}"), recursive=True)
        elif any(ch in entry for ch in "*?["):
            files += glob.glob(entry, recursive=True)
        elif os.path.exists(entry):
            files.append(entry)
        else:
            raise MissingFile(f"No such file or folder: {entry}")
    files = sorted(set(files))
    if not files:
        raise MissingFile(f"No {'/'.join(LOCAL_SUFFIXES)} files found in {', '.join(paths)}")
    for path in files:
        if not path.endswith(LOCAL_SUFFIXES):
            raise UsageError(f"{path}: unsupported file type; use one of {', '.join(LOCAL_SUFFIXES)}")
    return files


def _read_text_file(path: str) -> Iterator[str]:
    """A .txt file as one document; a decoding error names the file and the byte offset."""
    text = _text_of(path)
    if text.strip():
        yield text


# A lone .txt file without a blank line is cut into documents of this many lines (`split_text`).
LINES_PER_DOCUMENT = 100


def split_text(text: str) -> list[str]:
    r"""One text file's documents: its paragraphs (blocks of lines between blank lines), or, when it has no blank
    line, runs of `LINES_PER_DOCUMENT` lines. A line is never cut, and the same text always gives the same documents.

        "a\nb\n\n\nc\n" -> ["a\nb", "c"]

    Why not a document per line, as run_clm.py's `text` loader reads a file: the documents are shuffled before
    they are split and packed, so wrapped prose would be trained on in a jumbled order of its lines, with <eos>
    at each line break. nanoGPT cuts its one file by characters (90/10), which keeps a paragraph whole only by
    chance; litgpt's TextFiles refuses one file. Blank lines are where a plain text file says a passage ends.
    """
    paragraphs = [p.lstrip("\r\n").rstrip() for p in _BLANK_LINES.split(text)]
    paragraphs = [p for p in paragraphs if p.strip()]
    if len(paragraphs) != 1:
        return paragraphs
    lines = paragraphs[0].split("\n")
    chunks = ["\n".join(lines[i : i + LINES_PER_DOCUMENT]) for i in range(0, len(lines), LINES_PER_DOCUMENT)]
    return [c for c in chunks if c.strip()]


_BLANK_LINES = re.compile(r"\n(?:[ \t\r\f\v]*\n)+")  # lines holding only whitespace end a paragraph


def _text_of(path: str) -> str:
    """The text of a .txt file; a decoding error names the file and the byte offset."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as error:
        raise UsageError(
            f"{path}: not valid UTF-8 at byte {error.start} ({error.reason}); convert the file to UTF-8"
        ) from error
    except OSError as error:
        raise OSError(f"{path}: cannot be read ({error.strerror})") from error
    return text


def _table_column(path: str, column: str, streaming: bool = False) -> Iterator[str]:
    """The `column` of a .jsonl/.json/.csv/.parquet file, read with `datasets` (streamed: row by row, no Arrow
    cache written)."""
    import datasets

    builder = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}[os.path.splitext(path)[1]]
    try:
        table = datasets.load_dataset(builder, data_files=path, split="train", streaming=streaming)
    except Exception as error:  # datasets raises many kinds; the file name is what the user needs
        raise UsageError(f"{path}: cannot be read as {builder} ({error})") from error
    if streaming:
        yield from _streamed_column(table, path, column)
        return
    if column not in table.column_names:
        raise MissingKey(f"{path}: no column {column!r}; the columns are {table.column_names}")
    for value in table[column]:
        if isinstance(value, str) and value:
            yield value


def _streamed_column(table, path: str, column: str) -> Iterator[str]:
    """A streamed table's column; its columns are known only once a row is read, so the check is on each row."""
    try:
        for row in table:
            if column not in row:
                raise MissingKey(f"{path}: no column {column!r}; the columns are {sorted(row)}")
            value = row[column]
            if isinstance(value, str) and value:
                yield value
    except KeyError:
        raise
    except Exception as error:  # a malformed line surfaces while reading, not while opening
        raise UsageError(f"{path}: cannot be read ({' '.join(str(error).split())})") from error


def local_corpus(paths: str | list[str], text_column: str = "text", streaming: bool = False) -> Corpus:
    """Local files: .txt, or the `text_column` of .jsonl/.json/.csv/.parquet (with `streaming`, read row by row
    without writing `datasets`' Arrow cache). Among several files a .txt file is one document; a lone .txt file
    is a corpus of its own, split into documents at blank lines (`split_text`)."""
    files = _expand(paths)
    if len(files) == 1 and files[0].endswith(".txt"):
        return Corpus(
            f"local: {files[0]}, split into documents at blank lines",
            lambda: iter(split_text(_text_of(files[0]))),
            tuple(files),
        )

    def documents() -> Iterator[str]:
        for path in files:
            if path.endswith(".txt"):
                yield from _read_text_file(path)
            else:
                yield from _table_column(path, text_column, streaming)

    return Corpus(f"local: {len(files)} file(s) from {paths}", documents, tuple(files))


def too_few_documents(corpus: Corpus, needed: int, why: str) -> None:
    """Refuse a corpus of local files that gives fewer than `needed` documents, before anything is built from it
    (reading stops at the `needed`-th). `why`: what the documents are needed for."""
    if not corpus.files:
        return  # the embedded corpus is large; a dataset is not read twice to count it
    found = sum(1 for _ in itertools.islice((text for text in corpus if text.strip()), needed))  # with text
    if found >= needed:
        return
    if len(corpus.files) == 1 and corpus.files[0].endswith(".txt"):
        fix = (
            f"add text, or separate its documents with blank lines (a file without any is cut every "
            f"{LINES_PER_DOCUMENT} lines)"
        )
    else:
        fix = "add text or files (among several files each .txt file is one document)"
    names = ", ".join(corpus.files) if len(corpus.files) <= 3 else f"the {len(corpus.files)} files"
    if found == 0:
        raise UsageError(f"The corpus is empty ({names}: no document has any text).")
    give = "gives" if len(corpus.files) == 1 else "give"
    raise UsageError(f"{names} {give} {found} document(s); at least {needed} are needed {why}: {fix}.")


def _is_saved_dataset(folder: str) -> bool:
    """A folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`."""
    return any(os.path.exists(os.path.join(folder, name)) for name in ("dataset_dict.json", "state.json"))


def load_saved_dataset(folder: str, split: str, streaming: bool = False):
    """`datasets.load_from_disk`, and the split asked for when the folder holds several."""
    import datasets

    try:
        dataset = datasets.load_from_disk(folder)
    except Exception as error:  # a torn or foreign folder: name it
        raise UsageError(f"{folder}: cannot be read with datasets.load_from_disk ({error})") from error
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise MissingKey(f"{folder} has no split {split!r}; its splits are {sorted(dataset)}")
        dataset = dataset[split]
    return dataset.to_iterable_dataset() if streaming else dataset


def load_hub_dataset(name: str, config: str | None, split: str, streaming: bool = False):
    """`datasets.load_dataset` (a Hub name, or a local folder of data files), or `load_from_disk` for a folder
    that `save_to_disk` wrote; with an error that says what failed and what to do instead."""
    import datasets

    if os.path.isdir(name) and _is_saved_dataset(name):
        return load_saved_dataset(name, split, streaming)
    if not os.path.isdir(name) and (os.path.isabs(name) or name.startswith((".", "~")) or os.path.exists(name)):
        raise MissingFile(f"No such dataset folder: {name}")
    if os.path.isdir(name):
        try:
            return datasets.load_dataset(name, config, split=split, streaming=streaming)
        except Exception as error:
            raise UsageError(f"{name}: datasets cannot read this folder ({' '.join(str(error).split())})") from error
    try:
        return datasets.load_dataset(name, config, split=split, streaming=streaming)
    except Exception as error:
        from huggingface_hub import constants

        offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_DATASETS_OFFLINE") == "1"
        hint = (
            "The Hub cannot be reached (offline mode is on)"
            if offline
            else "It may not exist, or the Hub cannot be reached from here"
        )
        raise ConnectionError(
            f"Cannot load the dataset {name!r} (config {config!r}, split {split!r}): {error}. {hint}; pass local "
            "files instead (--files), or run without a dataset to use the embedded default corpus."
        ) from error


def hub_corpus(
    name: str, config: str | None = None, split: str = "train", text_column: str = "text", streaming: bool = False
) -> Corpus:
    """A `datasets` dataset by name (from the Hub or its local cache), one document per row of `text_column`."""
    dataset = load_hub_dataset(name, config, split, streaming)
    columns = list(dataset.column_names or [])
    if columns and text_column not in columns:
        raise MissingKey(f"Dataset {name!r} has no column {text_column!r}; the columns are {columns}")

    def documents() -> Iterator[str]:
        for row in dataset:
            value = row[text_column]
            if isinstance(value, str) and value:
                yield value

    return Corpus(f"datasets: {name}{'/' + config if config else ''} [{split}] column {text_column!r}", documents)


def add_corpus_arguments(parser: argparse.ArgumentParser) -> None:
    """--files or --dataset; neither means the embedded default corpus (the flags `corpus_from_args` reads)."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--files", nargs="+", metavar="PATH", help="local .txt/.jsonl/.json/.csv/.parquet files, globs or folders"
    )
    source.add_argument("--dataset", metavar="NAME", help="a `datasets` dataset (Hub name or local path)")
    parser.add_argument("--dataset-config", default=None, help="the dataset's configuration name")
    parser.add_argument("--split", default="train", help="dataset split (default: train)")
    parser.add_argument("--text-column", default="text", help="column holding the text (default: text)")
    parser.add_argument(
        "--streaming", action="store_true", help="read --files / --dataset as a stream, without an Arrow cache"
    )


def corpus_from_args(args: argparse.Namespace) -> Corpus:
    """The corpus the flags of `add_corpus_arguments` name."""
    if args.files:
        return local_corpus(args.files, text_column=args.text_column, streaming=getattr(args, "streaming", False))
    if args.dataset:
        return hub_corpus(args.dataset, args.dataset_config, args.split, args.text_column, args.streaming)
    return default_corpus()
