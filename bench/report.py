"""What every benchmark shares: the side-by-side table (medians and the Deriv / peer ratio) and the entry point."""

from __future__ import annotations

import argparse
import json
import os

from ..errors import MissingFile, UsageError


def side_by_side(title: str, notes: list[str], rows: list[tuple], peer: str, peer_key: str, json_path=None) -> None:
    """Print `rows` of (metric, deriv, peer, unit) as a Markdown table with the ratio; optionally as JSON too."""
    width = max([len("metric"), *(len(r[0]) for r in rows)])
    print(title)
    for note in notes:
        print(note)
    print(f"| {'metric':<{width}} | {'Deriv':>10} | {peer:>10} | {'ratio':>6} | unit |")
    print(f"|{'-' * (width + 2)}|{'-' * 12}:|{'-' * 12}:|{'-' * 7}:|------|")
    for name, ours, theirs, unit in rows:
        print(f"| {name:<{width}} | {ours:>10.1f} | {theirs:>10.1f} | {ours / theirs:>6.2f} | {unit} |")
    if json_path:
        write_rows_json(json_path, title, rows, peer_key)


def write_rows_json(path: str, title: str, rows: list[tuple], peer_key: str, extra: dict | None = None) -> None:
    """The rows of `side_by_side` as JSON objects, with whatever else a benchmark measured under `extra`'s keys."""
    keys = ("metric", "deriv", peer_key, "unit")
    with open(path, "w") as f:
        json.dump(
            {"title": title, "rows": [dict(zip(keys, r, strict=True)) for r in rows], **(extra or {})}, f, indent=2
        )


def markdown_table(headers: list[str], rows: list[list], digits: int = 1) -> None:
    """Print a Markdown table: text cells left-aligned, numbers right-aligned with `digits` decimals."""
    cells = [[f"{c:.{digits}f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], (int, float)) for row in rows) for i in range(len(headers))]
    print("| " + " | ".join(f"{h:<{w}}" for h, w in zip(headers, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 1) + (":" if n else "-") for w, n in zip(widths, numeric, strict=True)) + "|")
    for row in cells:
        print(
            "| "
            + " | ".join(f"{c:>{w}}" if n else f"{c:<{w}}" for c, w, n in zip(row, widths, numeric, strict=True))
            + " |"
        )


def check_json_path(path: str | None, flag: str = "--json") -> None:
    """Refuse an output file that cannot be written, before minutes (or hours) of measuring, not after: no name
    (`--json ''` measured for 42 s and wrote nothing), a folder, a folder that does not exist or is a file, a
    folder or file this user may not write."""
    if path is None:
        return
    if not path.strip():
        raise UsageError(f"{flag} {path!r}: give the name of the file to write")
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path} is a folder; give the file to write, such as {os.path.join(path, 'x')}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        what = "is a file, not a folder" if os.path.exists(parent) else "does not exist"
        raise MissingFile(f"{flag} {path}: the folder {os.path.dirname(path) or '.'} {what}")
    target = path if os.path.exists(path) else parent
    if not os.access(target, os.W_OK):
        raise UsageError(f"{flag} {path}: {'the file' if target == path else 'its folder'} is not writable")


def entry_point(doc: str, add_arguments, run):
    """`main(argv)` for `python -m deriv_lm.bench.<name>`: parse with the module's arguments, then run."""

    def main(argv=None) -> int:
        parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        add_arguments(parser)
        return run(parser.parse_args(argv))

    return main
