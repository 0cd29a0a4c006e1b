"""A tokenizer that would run the folder's own code, refused before transformers is asked, unless the user consents.

transformers loads a tokenizer class from a folder's own Python module when `tokenizer_config.json` (or
`config.json`) names one under `auto_map.AutoTokenizer`. Asked with `trust_remote_code` unset, the default of
`AutoTokenizer.from_pretrained`, it asks on stdin "Do you wish to run the custom code? [y/N]": a command that
was never meant to run a folder's code stops for an answer, answering y runs it, and with stdin at its end the
question is a traceback. With `trust_remote_code=False` it says nothing and loads the class `tokenizer_class`
names instead, which is not the tokenizer the folder's author meant either.

So every path that loads a tokenizer from a local folder calls `check_tokenizer_code` first: a folder whose
tokenizer is code of its own is one UsageError naming the file and the class, unless the user passed the flag
that consents (`--trust-remote-code`); where the command has no such flag (`--init-from`, `--tokenizer`), it is
refused outright. Deriv's own folders never name one: their tokenizer is `tokenizer.json`, read by `tokenizers`.
"""

from __future__ import annotations

import json
import os

from ..errors import UsageError
from .inside import read_bytes_inside


def tokenizer_code(folder: str | os.PathLike) -> tuple[str, str] | None:
    """(the file, the class) when `folder`'s tokenizer_config.json or config.json maps AutoTokenizer to a module
    of the folder's own (`auto_map`), or None. A file that is absent or is not a JSON object names none: the
    loader that reads it next says what is wrong with it."""
    for name in ("tokenizer_config.json", "config.json"):
        if not os.path.lexists(os.path.join(folder, name)):
            continue
        try:
            config = json.loads(read_bytes_inside(folder, name).decode("utf-8"))
        except (ValueError, RecursionError):  # not UTF-8, not JSON, nested past the parser: the loader's to say
            continue
        auto_map = config.get("auto_map") if isinstance(config, dict) else None
        # {"AutoTokenizer": ["m.Slow", "m.Fast"]}, or (an old tokenizer_config.json) the pair itself
        refs = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else auto_map
        refs = refs if isinstance(refs, (list, tuple)) else [refs]
        named = [ref for ref in refs if isinstance(ref, str) and ref.strip()]
        if named:
            return name, named[-1]
    return None


def check_tokenizer_code(
    folder: str | os.PathLike, trust_remote_code: bool = False, consent: str | None = "--trust-remote-code"
) -> None:
    """Refuse a local `folder` whose tokenizer is code of its own (`tokenizer_code`) unless `trust_remote_code`;
    `consent` is the flag that gives it (None: the command has none). A Hub name is left to transformers, which
    is then always given `trust_remote_code` as a bool and so never asks."""
    if trust_remote_code or not os.path.isdir(folder):
        return
    found = tokenizer_code(folder)
    if found is None:
        return
    name, ref = found
    how = f"if you trust its code, pass {consent}" if consent else "this command runs no folder's code"
    raise UsageError(
        f"{os.path.join(folder, name)} maps AutoTokenizer to the folder's own code ({ref}), which would run as "
        f"the tokenizer loads; {how}"
    )
