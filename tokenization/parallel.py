"""Parallel text (source -> target pairs) for the translation model: the embedded default corpus.

The default is English -> German (or another language) software messages from the gettext
catalogs a Debian-like system already carries, `/usr/share/locale/<lang>/LC_MESSAGES/*.mo`, read
with Python's own `gettext` parser: offline, real, and about 40 thousand pairs for German.
"""

from __future__ import annotations

import gettext
import glob
import hashlib
import os
import re
from dataclasses import dataclass


LOCALE_DIR = "/usr/share/locale"
# printf / Python / brace placeholders and the like: "%s", "%(name)d", "{0}", "%1$s", "$HOME"
_PLACEHOLDER = re.compile(r"%(\([^)]*\))?[-+ #0-9.*$lhLqjzt]*[a-zA-Z%]|\{[^{}]*\}|\$\{?\w+\}?")


@dataclass(frozen=True)
class Pair:
    source: str
    target: str


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
        raise FileNotFoundError(
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
