"""One rule for "inside the folder", for every reader and writer of a model folder.

A folder someone hands you (a download, a colleague's run, a pull request) can hold things that are not what
their names say: a `notes.md` that is a symbolic link to `~/.ssh/id_ed25519`, a `config2.json` linked to
`/etc/passwd`, a `docs/` linked to another folder, a FIFO named `extra.safetensors` (opening it blocks for
ever), a socket, a device. git refuses paths that leave the work tree and huggingface_hub's upload does not
follow links out of a folder; Deriv holds every folder to the same rule:

    an entry is inside the folder only if it is a regular file (or a folder) whose resolved path stays inside
    the folder's own resolved path.

A link that stays inside (`tokenizer.json -> tokenizer/tokenizer.json`) is inside; a link that leaves, a link
that leads nowhere, a FIFO, a socket or a device is refused by name (`OutsideFolder`, a UsageError) before
anything is opened or read. Names that are no file name at all (a NUL, a lone surrogate from a JSON index, an
absolute path, `..`) are refused the same way.

    check_inside(folder, "model.safetensors")        # the checked path, or OutsideFolder naming the entry
    problems(folder)                                 # every entry of the tree that breaks the rule, described
    files_inside(folder)                             # (relative path, bytes) of every regular file, or refuse
    read_bytes_inside(folder, "config.json")         # never blocks on a FIFO, never follows a link out

Standard library only: the training, hub, loading and writing rooms all use it.
"""

from __future__ import annotations

import os
import stat

from ..errors import UsageError


class OutsideFolder(UsageError):
    """An entry of a folder that is not a regular file or folder inside it (a link out, a FIFO, a device, ...)."""


def _kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    return "not a regular file"


def _name_problem(rel: object) -> str | None:
    """Why `rel` is no relative file name inside a folder, or None."""
    if not isinstance(rel, str) or not rel:
        return "is not a file name"
    if "\x00" in rel:
        return "holds a NUL character, which no file name can"
    try:
        os.fsencode(rel)
    except UnicodeError:
        return "is not a file name this system can encode (a lone surrogate?)"
    if os.path.isabs(rel) or rel.startswith(("/", "\\")):
        return "is an absolute path, outside the folder"
    if ".." in rel.replace("\\", "/").split("/"):
        return "climbs out of the folder (..)"
    return None


def entry_problem(folder: str | os.PathLike, rel: str, want: str = "file") -> str | None:
    """Why `folder/rel` is not a regular file (`want="file"`) or folder (`want="dir"`) inside `folder`; None
    when it is, and also when it does not exist (the caller decides what missing means)."""
    why = _name_problem(rel)
    if why:
        return why
    folder = os.fspath(folder)
    path = os.path.join(folder, rel)
    try:
        own = os.lstat(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        return f"cannot be read ({error.strerror if isinstance(error, OSError) else error})"
    if stat.S_ISLNK(own.st_mode):
        root = os.path.realpath(folder)
        target = os.path.realpath(path)
        if os.path.commonpath([root, target]) != root:
            return f"is a symbolic link that leads outside the folder (to {target})"
        try:
            own = os.stat(path)
        except OSError:
            return "is a symbolic link that leads nowhere"
    else:  # a folder on the way may itself be a link out: `docs/notes.md` with `docs -> /elsewhere`
        root = os.path.realpath(folder)
        if os.path.commonpath([root, os.path.realpath(path)]) != root:
            return f"lies outside the folder (through a link, at {os.path.realpath(path)})"
    if want == "dir" and stat.S_ISDIR(own.st_mode):
        return None
    if want == "file" and stat.S_ISREG(own.st_mode):
        return None
    if stat.S_ISDIR(own.st_mode):
        return "is a folder, not a file"
    if stat.S_ISREG(own.st_mode):
        return "is a file, not a folder"
    return f"is {_kind(own.st_mode)}, not a regular file"


def check_inside(folder: str | os.PathLike, rel: str, want: str = "file", what: str = "") -> str:
    """`folder/rel` once it is known to be a regular file (or folder) inside `folder`, or missing; otherwise
    OutsideFolder naming the entry (and `what` it was wanted as)."""
    why = entry_problem(folder, rel, want)
    if why:
        label = f" ({what})" if what else ""
        raise OutsideFolder(
            f"{os.path.join(os.fspath(folder), str(rel))!r}{label} {why}; deriv reads and publishes "
            "only regular files inside a folder"
        )
    return os.path.join(os.fspath(folder), rel)


def problems(folder: str | os.PathLike, skip=None) -> list[str]:
    """Every entry below `folder` that breaks the rule, as `relative/path (why)`, sorted. Links are not followed
    into (a link to a folder inside is checked as an entry, not walked twice). `skip(rel)` leaves subtrees out."""
    found = []
    for rel, why in _walk(os.fspath(folder), skip):
        if why:
            found.append(f"{rel} ({why})")
    return found


def files_inside(folder: str | os.PathLike, skip=None) -> list[tuple[str, int]]:
    """(relative path with '/', bytes) of every regular file below `folder`, sorted; OutsideFolder naming every
    entry that breaks the rule, if any (so nothing a listing shows is a link out or a special file)."""
    folder = os.fspath(folder)
    files, bad = [], []
    for rel, why in _walk(folder, skip):
        if why:
            bad.append(f"{rel} ({why})")
        else:
            files.append((rel, os.stat(os.path.join(folder, rel)).st_size))
    if bad:
        raise OutsideFolder(
            f"{folder} holds {len(bad)} entr{'y' if len(bad) == 1 else 'ies'} that {'is' if len(bad) == 1 else 'are'}"
            f" not a regular file inside it: {'; '.join(bad)}; deriv reads and publishes only regular files inside "
            "a folder (replace a link with the file itself, remove special files)"
        )
    return files


def _walk(folder: str, skip=None):
    """(relative path, why-or-None) for each file-like entry below `folder`; folders that are real and inside are
    walked, never followed through a link."""
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        keep = []
        for name in dirs:
            rel = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            if skip and skip(rel + "/"):
                continue
            if os.path.islink(os.path.join(root, name)):  # os.walk does not descend into it: judge it as an entry
                why = entry_problem(folder, rel, want="dir")
                yield rel, why or "is a symbolic link to a folder; publish the folder itself"
                continue
            keep.append(name)
        dirs[:] = keep
        for name in sorted(names):
            rel = os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/")
            if skip and skip(rel):
                continue
            yield rel, entry_problem(folder, rel)


def read_bytes_inside(folder: str | os.PathLike, rel: str, what: str = "", limit: int | None = None) -> bytes:
    """The bytes of `folder/rel`, a regular file inside `folder` (MissingFile if absent): opened without
    following a final link out and without blocking (a FIFO swapped in after the check is refused by fstat)."""
    from ..errors import MissingFile

    path = check_inside(folder, rel, what=what)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise MissingFile(f"{path} is missing") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OutsideFolder(f"{path!r} is {_kind(mode)}, not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read() if limit is None else f.read(limit)
    finally:
        os.close(fd)


def is_regular_inside(folder: str | os.PathLike, rel: str) -> bool:
    """Whether `folder/rel` exists and is a regular file inside `folder` (a non-raising `check_inside`)."""
    return entry_problem(folder, rel) is None and os.path.isfile(os.path.join(os.fspath(folder), rel))
