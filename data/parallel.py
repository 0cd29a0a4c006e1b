"""Parallel text (source -> target pairs) for the translation model.

Three sources, one result (`ParallelCorpus`):
- the embedded default: English -> German (or another language) software messages from the gettext
  catalogs a Debian-like system already carries, `/usr/share/locale/<lang>/LC_MESSAGES/*.mo`, read
  with Python's own `gettext` parser: offline, real, and about 40 thousand pairs for German;
- local files: `.tsv` (source TAB target per line) or `.jsonl` / `.json` rows;
- a `datasets` dataset with a `translation` column of {language: text} (the WMT / OPUS layout).

Pairs with an empty side are skipped and counted. Splits come from a hash of the source text, so
they are the same on every machine and every translation of one source lands in one split.
"""

from __future__ import annotations

import gettext
import glob
import hashlib
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..errors import MissingFile, MissingKey, UsageError


LOCALE_DIR = "/usr/share/locale"
# printf / Python / brace placeholders and the like: "%s", "%(name)d", "{0}", "%1$s", "$HOME"
_PLACEHOLDER = re.compile(r"%(\([^)]*\))?[-+ #0-9.*$lhLqjzt]*[a-zA-Z%]|\{[^{}]*\}|\$\{?\w+\}?")


@dataclass(frozen=True)
class Pair:
    source: str
    target: str


@dataclass
class ParallelCorpus:
    description: str
    pairs: list[Pair]
    skipped_empty: int = 0  # pairs dropped because one side was empty
    files: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.pairs)


def _collect(rows: Iterable[tuple[object, object]]) -> tuple[list[Pair], int]:
    """Pairs of non-empty strings (stripped), and how many rows had an empty or missing side."""
    pairs, skipped = [], 0
    for source, target in rows:
        source = source.strip() if isinstance(source, str) else ""
        target = target.strip() if isinstance(target, str) else ""
        if source and target:
            pairs.append(Pair(source, target))
        else:
            skipped += 1
    return pairs, skipped


def _languages_of(row: dict) -> list[str]:
    value = row.get("translation")
    return sorted(value) if isinstance(value, dict) else sorted(k for k, v in row.items() if isinstance(v, str))


def _side(row: dict, language: str, where: str):
    """row["translation"][language] (WMT / OPUS), else row[language]; an error lists what is there."""
    value = row.get("translation")
    table = value if isinstance(value, dict) else row
    if language not in table:
        raise MissingKey(f"{where}: no {language!r} text; the languages (or columns) there are {_languages_of(row)}")
    return table[language]


def _tsv_rows(path: str) -> Iterator[tuple[str, str]]:
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                line = line.rstrip("\r\n")
                if not line.strip():
                    continue
                fields = line.split("\t")
                if len(fields) != 2:
                    raise UsageError(
                        f"{path}:{number}: expected 'source<TAB>target', found {len(fields)} tab-separated field(s)"
                    )
                yield fields[0], fields[1]
    except UnicodeDecodeError as error:
        raise UsageError(f"{path}: not valid UTF-8 at byte {error.start}; convert the file to UTF-8") from error


def local_pairs(paths: str | list[str], source_lang: str = "en", target_lang: str = "de") -> ParallelCorpus:
    """Pairs from .tsv files (source TAB target) or .jsonl / .json rows: {"translation": {"en": .., "de": ..}},
    {"en": .., "de": ..}, or {"source": .., "target": ..}."""
    import datasets

    paths = [paths] if isinstance(paths, str) else list(paths)
    files = []
    for path in paths:
        if not os.path.exists(path):
            raise MissingFile(f"No such file: {path}")
        if not path.endswith((".tsv", ".jsonl", ".json")):
            raise UsageError(f"{path}: parallel data must be .tsv (source<TAB>target), .jsonl or .json")
        files.append(path)
    pairs, skipped = [], 0
    for path in files:
        if path.endswith(".tsv"):
            rows = _tsv_rows(path)
        else:
            try:
                table = datasets.load_dataset("json", data_files=path, split="train")
            except Exception as error:  # datasets raises many kinds; the file name is what the user needs
                raise UsageError(f"{path}: cannot be read as JSON lines ({error})") from error
            names = (source_lang, target_lang)
            if {"source", "target"} <= set(table.column_names) and "translation" not in table.column_names:
                names = ("source", "target")
            rows = ((_side(r, names[0], path), _side(r, names[1], path)) for r in table)
        found, dropped = _collect(rows)
        pairs += found
        skipped += dropped
    description = f"local: {len(files)} file(s) {', '.join(files)} ({source_lang} -> {target_lang})"
    return ParallelCorpus(description, pairs, skipped, tuple(files))


def hub_pairs(
    name: str, config: str | None, split: str, source_lang: str = "en", target_lang: str = "de"
) -> ParallelCorpus:
    """A `datasets` dataset with a `translation` column (WMT / OPUS) or one column per language."""
    from .corpus import load_hub_dataset

    dataset = load_hub_dataset(name, config, split)
    where = f"dataset {name!r}"
    if len(dataset):
        _side(dataset[0], source_lang, where), _side(dataset[0], target_lang, where)
    pairs, skipped = _collect((_side(r, source_lang, where), _side(r, target_lang, where)) for r in dataset)
    tag = f"{name}{'/' + config if config else ''} [{split}]"
    return ParallelCorpus(f"datasets: {tag} ({source_lang} -> {target_lang})", pairs, skipped)


def default_pairs(target_lang: str = "de", locale_dir: str = LOCALE_DIR) -> ParallelCorpus:
    """The embedded default: this machine's gettext catalogs, English -> `target_lang`."""
    pairs = gettext_pairs(target_lang, locale_dir)
    where = os.path.join(locale_dir, target_lang, "LC_MESSAGES", "*.mo")
    return ParallelCorpus(f"default: gettext messages en -> {target_lang} from {where}", pairs)


def _has_words(text: str) -> bool:
    """True when something is left besides placeholders, digits and punctuation: a message, not a format."""
    return bool(re.search(r"[^\W\d_]{2,}", _PLACEHOLDER.sub(" ", text)))


def _catalog_pairs(path: str) -> list[Pair]:
    with open(path, "rb") as f:
        try:
            catalog = gettext.GNUTranslations(f)._catalog  # the parsed msgid -> msgstr table
        except (OSError, UnicodeDecodeError):
            return []  # a damaged or non-UTF-8 catalog: skip it, the others still count
    pairs = []
    for key, target in catalog.items():
        if isinstance(key, tuple):  # plural forms: (msgid, n); keep the singular
            key, n = key
            if n != 0:
                continue
        source = key.split("\x04", 1)[-1]  # drop a msgctxt prefix ("context\x04message")
        source, target = source.strip(), target.strip()
        if not source or not target or source == target:  # the header, untranslated entries
            continue
        if not _has_words(source) or not _has_words(target):
            continue
        pairs.append(Pair(source, target))
    return pairs


def gettext_pairs(language: str = "de", locale_dir: str = LOCALE_DIR) -> list[Pair]:
    """All English -> `language` message pairs of the machine's gettext catalogs, deduplicated, sorted."""
    paths = sorted(glob.glob(os.path.join(locale_dir, language, "LC_MESSAGES", "*.mo")))
    if not paths:
        raise MissingFile(
            f"No gettext catalogs for {language!r} in {os.path.join(locale_dir, language, 'LC_MESSAGES')}. "
            "Pass parallel data instead: --dataset NAME (a `translation` column, the WMT/OPUS layout) or "
            "--files pairs.tsv / pairs.jsonl."
        )
    unique = {pair for path in paths for pair in _catalog_pairs(path)}
    return sorted(unique, key=lambda p: (p.source, p.target))


def split_of(pair: Pair, validation: float = 0.02, test: float = 0.02) -> str:
    """'train', 'validation' or 'test', from a hash of the source: the same on every machine and run,
    and every translation of one source message lands in the same split."""
    bucket = int.from_bytes(hashlib.sha256(pair.source.encode()).digest()[:8], "big") / 2**64
    return "test" if bucket < test else "validation" if bucket < test + validation else "train"


def split_pairs(pairs: list[Pair], validation: float = 0.02, test: float = 0.02) -> dict[str, list[Pair]]:
    parts: dict[str, list[Pair]] = {"train": [], "validation": [], "test": []}
    for pair in pairs:
        parts[split_of(pair, validation, test)].append(pair)
    return parts


def pairs_from_args(args) -> ParallelCorpus:
    """The pairs `args` name: --files, --dataset, or the embedded default (gettext catalogs, English -> X)."""
    if args.files:
        return local_pairs(args.files, args.source_lang, args.target_lang)
    if args.dataset:
        return hub_pairs(args.dataset, args.dataset_config, args.split, args.source_lang, args.target_lang)
    if args.source_lang != "en":
        raise UsageError(
            f"The embedded default corpus translates from English (gettext catalogs are keyed by their English "
            f"messages); for --source-lang {args.source_lang} pass --dataset NAME or --files pairs.tsv."
        )
    return default_pairs(args.target_lang)
