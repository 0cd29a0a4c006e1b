"""Writing folders so that an interruption never replaces a good one with a half-written one."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def atomic_directory(folder: str | os.PathLike) -> Iterator[str]:
    """Yield a temporary folder beside `folder`; on success it replaces `folder`, on failure it is removed.

    Files already in `folder` that the new contents do not replace are kept (a tokenizer written
    into a model folder leaves the model's files alone).
    """
    folder = os.path.abspath(folder)
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.partial-", dir=parent)
    try:
        yield tmp
        os.makedirs(folder, exist_ok=True)
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(folder, name))  # atomic per file, same filesystem
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
