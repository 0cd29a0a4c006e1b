"""Argument types for the `deriv` commands: a numeric flag states its range once, where it is declared.

    parser.add_argument("--num-beams", type=integer(minimum=1))
    parser.add_argument("--top-p", type=number(above=0, maximum=1))

argparse calls the type on the text of the flag, so a value outside its range is refused before any
work starts, as `deriv: error: argument --num-beams: must be an integer >= 1, got '0'`. Only finite
numbers pass (`nan` and `inf` are refused: no range means anything for them).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

from .errors import UsageError


# The widest beam search a command runs (--num-beams, and --num-return-sequences, which cannot exceed it). Each
# beam keeps a KV cache of its own, so memory grows with the width: 64 beams of the gpt2-124m preset at its full
# context of 1024 hold 4.8 GB of cache (llama-124m's 4 key/value heads, a third: 1.6 GB), while 100,000 beams end
# in an allocation failure or minutes of work. And wider is not better: Koehn & Knowles (2017, "Six Challenges for
# Neural Machine Translation") saw translation quality fall as beams grew past 5 to 10. The vocabulary would be no
# bound: every tokenizer here has more ids (256 bytes at least) than anyone would want beams.
MAX_BEAMS = 64

# torch.manual_seed takes 64 bits, numpy (and transformers' set_seed, which seeds it) 32: a seed that works for all.
MAX_SEED = 2**32 - 1

# The presence and frequency penalties, as the OpenAI API bounds them: one range for `deriv generate` and `deriv
# chat`'s flags, `deriv serve`'s requests and the explorer's controls.
PENALTY_LIMIT = 2.0

# The servers' bounds on one client (`deriv serve`, `deriv explore`; serving/guard.py): the seconds a request body
# may take to arrive once its headers have (`deriv serve --read-timeout`), and the bytes of the request line and
# headers together (h11's own default).
BODY_SECONDS = 30.0
MAX_HEADER_BYTES = 16 * 1024


def _bounds(minimum, maximum, above, below) -> str:
    parts = []
    if minimum is not None:
        parts.append(f">= {minimum}")
    if above is not None:
        parts.append(f"> {above}")
    if maximum is not None:
        parts.append(f"<= {maximum}")
    if below is not None:
        parts.append(f"< {below}")
    return " and ".join(parts)


def _within(value, minimum, maximum, above, below) -> bool:
    return not (
        (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
        or (above is not None and value <= above)
        or (below is not None and value >= below)
    )


def integer(minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number within [minimum, maximum] (either end may be open)."""
    wanted = " ".join(filter(None, ["an integer", _bounds(minimum, maximum, None, None)]))

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}") from None
        if not _within(value, minimum, maximum, None, None):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
        return value

    parse.__name__ = "integer"
    return parse


def number(
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    above: float | None = None,
    below: float | None = None,
) -> Callable[[str], float]:
    """An argparse type: a finite number within the bounds (`minimum`/`maximum` inclusive, `above`/`below` not)."""
    wanted = " ".join(filter(None, ["a number", _bounds(minimum, maximum, above, below)]))

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}") from None
        if not math.isfinite(value) or not _within(value, minimum, maximum, above, below):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def invalid_text(value: str) -> str | None:
    """Why `value` is not text a tokenizer can take, or None: a lone surrogate (`"\\ud800"` in JSON), or a byte that
    was not UTF-8 (Python reads such a byte of a command line or a file as a surrogate, `surrogateescape`)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        char = ord(value[error.start])
        what = f"the byte 0x{char - 0xDC00:02x}, which is not UTF-8" if 0xDC80 <= char <= 0xDCFF else None
        return f"{what or f'a lone surrogate (U+{char:04X})'} at character {error.start}"
    return None


def plain_text(value: str) -> str:
    """An argparse type: text a model reads (a prompt, a message, a sentence), refused if it is not valid Unicode,
    as `deriv: error: argument prompt: not valid text: the byte 0xff, which is not UTF-8 at character 2`."""
    why = invalid_text(value)
    if why:
        raise argparse.ArgumentTypeError(f"not valid text: {why}")
    return value


def looks_local(text: str) -> bool:
    """A name that can only be a path: it exists, is absolute or relative (`.`), ends in a slash, has more than one
    slash, or starts in a folder that is here (`runs/deriv-tiny` with `runs/` present). Otherwise it may be a
    Hub name (`gpt2`, `user/model`), which only loading can check."""
    head = text.split("/")[0]
    return (
        os.path.exists(text)
        or os.path.isabs(text)
        or text.startswith(".")
        or text.endswith("/")
        or text.count("/") > 1
        or ("/" in text and os.path.isdir(head))
    )


def model_folder(text: str) -> str:
    """An argparse type: a model folder (one that holds config.json) or a Hub name. A path that is not there, or a
    folder without config.json, is refused as the line is parsed, before torch or transformers is imported."""
    if os.path.isdir(text):
        # subtle: lexists, not isfile: a config.json that is a FIFO or a link out is there, and the reader refuses
        # it naming what it is (folder/inside.py); "it has no config.json" would send the user looking for a file
        if not os.path.lexists(os.path.join(text, "config.json")):
            raise argparse.ArgumentTypeError(f"{text} is not a model folder: it has no config.json")
        return text
    if looks_local(text):
        raise argparse.ArgumentTypeError(f"{text}: no such model folder")
    return text


def existing_folder(text: str) -> str:
    """An argparse type: a folder that is there, or a Hub name (a tokenizer folder: config.json not required)."""
    if not os.path.isdir(text) and looks_local(text):
        raise argparse.ArgumentTypeError(f"No such folder: {text}")
    return text


def existing_file(text: str) -> str:
    """An argparse type: a file that is there (a config file, a text file), checked as the line is parsed."""
    if not os.path.isfile(text):
        why = "is a folder, not a file" if os.path.isdir(text) else "no such file"
        raise argparse.ArgumentTypeError(f"{text}: {why}")
    return text


def check_range(name: str, value, *, minimum=None, maximum=None, above=None, below=None, integral=False) -> None:
    """The same rule for values that do not come through argparse (config files, the Python API):
    raise UsageError naming `name` and the range when `value` lies outside it."""
    kind = "an integer" if integral else "a number"
    wanted = " ".join(filter(None, [kind, _bounds(minimum, maximum, above, below)]))
    if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
        raise UsageError(f"`{name}` must be {wanted}, got {value!r}")
    if not math.isfinite(value) or not _within(value, minimum, maximum, above, below):
        raise UsageError(f"`{name}` must be {wanted}, got {value!r}")


# Where a command with sub-commands keeps the one given (its `add_subparsers(dest=...)`).
_SUBCOMMAND = {"train": "task", "picture": "picture", "bench": "kind", "tokenizer": "tokenizer_command"}


def command_name(args: argparse.Namespace) -> str:
    """`deriv picture tokens`, `deriv train sft`, `deriv bench serving`: the command as typed, for messages."""
    sub = getattr(args, _SUBCOMMAND.get(args.command, ""), None)
    return " ".join(filter(None, ["deriv", args.command, sub]))
