"""Writing folders so that an interruption never replaces a good one with a half-written one.

`atomic_directory(folder)` builds the folder's next version complete in a sibling temporary folder (same
parent, so same filesystem), fsyncs it, and swaps it in with one rename. A kill at any instant leaves the old
folder or the new one, never a mixture; what a killed writer left beside the folder is removed the next time
one is written there.

Every writer goes through here, so every writer inherits the rule of `target.py` (may Deriv write this
folder?) and leaves the marker `.deriv` in what it writes (the names it wrote, so that a later `--overwrite`
can tell them from the user's). The carry-over of the old version never leaves the folder: a link out of it, a
FIFO, socket or device, or an entry on another filesystem is refused by name, never copied or followed.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import signal
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import UsageError
from .inside import _kind
from .target import check_target, foreign_names, mark


_PARTIAL = ".partial-"  # <parent>/.<name>.partial-<pid>-<random>: the next version, being written
_OLD = ".old-"  # <parent>/.<name>.old-<pid>-<random>: the previous version, between two renames (no renameat2)
_STAGING = ".overwrite"  # <parent>/.<name>.overwrite: a run that replaces the run in <name> works here (`staging`)
_OWNER = ".deriv-staging"  # in a staging folder: the process id of the run that works in it


@contextmanager
def atomic_directory(
    folder: str | os.PathLike,
    carry_first: bool = False,
    allow_existing: bool = False,
    replace: bool = False,
    carry_from: str | None = None,
) -> Iterator[str]:
    """Yield a temporary folder beside `folder`; on success the folder's new version replaces it whole.

    The new version is the old one's files (hard links, so a model folder's checkpoints cost nothing to
    carry) with what was written into the temporary folder on top: files already in `folder` that the new
    contents do not replace are kept (a tokenizer written into a model folder leaves the model's files alone).
    With `carry_first` the old files are linked in before the yield, for a writer that reads them (a card built
    from the folder): it must replace a file (`os.replace`), never write into it, which would change the old
    version through the shared link. On failure or a signal the temporary folder is removed and `folder` is
    untouched.

    `folder` must be one Deriv may write (`target.check_target`; a folder of the user's only with
    `allow_existing`), and a file of the user's in it is never replaced. With `replace` (--overwrite) the old
    version's Deriv files are not carried, only the user's; `carry_from` (the staging folder of such a run) is
    carried in before them.
    """
    folder = os.path.abspath(folder)
    parent, name = os.path.split(folder)
    check_target(folder, "", allow_existing=allow_existing, replace=replace)
    os.makedirs(parent, exist_ok=True)
    _remove_leftovers(parent, name)
    foreign = foreign_names(folder)
    tmp = tempfile.mkdtemp(prefix=f".{name}{_PARTIAL}{os.getpid()}-", dir=parent)
    try:
        if carry_first and os.path.isdir(folder):
            _carry_over(folder, tmp)
        yield tmp
        _refuse_replacing(folder, tmp, foreign)
        if carry_from is not None:
            _carry_over(carry_from, tmp, leave_out=(_OWNER,))
        if os.path.isdir(folder):
            _carry_over(folder, tmp, only=foreign if replace else None)
        mark(tmp, set(os.listdir(tmp)) - set(foreign), fresh=True)
        with_umask(tmp)
        fsync_tree(tmp)
        _swap_in(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # after a swap: the previous version, now under the temporary name


def _refuse_replacing(folder: str, tmp: str, foreign: list[str]) -> None:
    """Refuse a new version that replaces an entry of the user's (one Deriv did not write) in `folder`."""
    replaced = []
    for entry in foreign:
        new = os.path.join(tmp, entry)
        if os.path.lexists(new) and not os.path.samestat(os.lstat(new), os.lstat(os.path.join(folder, entry))):
            replaced.append(entry)
    if replaced:
        raise UsageError(
            f"{folder} holds {', '.join(replaced)}, which deriv did not write and will not replace; the folder is "
            "as it was: move them away or write to another folder"
        )


def user_umask() -> int:
    """The process's umask (read by setting it and back: the only way POSIX offers)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def with_umask(folder: str) -> None:
    """Give `folder` and everything in it the modes a plain `mkdir` and `open` would: 0o777 and 0o666 less the
    user's umask. subtle: the temporary folder is made by mkdtemp (0o700) and transformers writes safetensors
    through a temporary file (0o600): swapped in as they are, a folder copied to a shared place or served by a
    web server would be unreadable to anyone but its owner."""
    mask = user_umask()
    os.chmod(folder, 0o777 & ~mask)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def _carry_over(folder: str, tmp: str, only=None, leave_out=()) -> None:
    """Link every entry of `folder` that `tmp` does not already have (of `only`, if given) into `tmp` (copy where
    links fail). Nothing that leaves the folder is carried: `_carry_problems` refuses it by name first."""

    def link_or_copy(source: str, target: str) -> None:
        try:
            os.link(source, target)
        except OSError:  # a filesystem without hard links
            shutil.copy2(source, target, follow_symlinks=False)

    entries = [e for e in sorted(os.listdir(folder)) if (only is None or e in only) and e not in leave_out]
    entries = [e for e in entries if not os.path.lexists(os.path.join(tmp, e))]
    bad = _carry_problems(folder, entries)
    if bad:
        raise UsageError(
            f"{folder} holds {'; '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}: deriv carries only regular files "
            "and folders inside it into the folder's next version; the folder is as it was: remove or replace these"
        )
    for entry in entries:
        source, target = os.path.join(folder, entry), os.path.join(tmp, entry)
        if os.path.islink(source):
            os.symlink(os.readlink(source), target)
        elif os.path.isdir(source):
            shutil.copytree(source, target, symlinks=True, copy_function=link_or_copy)
        else:
            link_or_copy(source, target)


def _carry_problems(folder: str, entries: list[str]) -> list[str]:
    """`relative/path (why)` for each thing under `entries` of `folder` that the carry-over must not take: a
    symbolic link that leads outside `folder`, a FIFO, socket or device, an entry on another filesystem (a
    mount point inside: carried, it would copy a whole filesystem)."""
    root, device = os.path.realpath(folder), filesystem_of(os.lstat(folder))
    found = []

    def judge(path: str) -> bool:
        rel = os.path.relpath(path, folder)
        info = os.lstat(path)
        if filesystem_of(info) != device:
            found.append(f"{rel} (on another filesystem)")
        elif stat.S_ISLNK(info.st_mode):
            if os.path.commonpath([root, os.path.realpath(path)]) != root:
                found.append(f"{rel} (a symbolic link that leads outside the folder, to {os.path.realpath(path)})")
        elif not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
            found.append(f"{rel} ({_kind(info.st_mode)})")
        else:
            return stat.S_ISDIR(info.st_mode)
        return False

    for entry in entries:
        top = os.path.join(folder, entry)
        if not judge(top):
            continue
        for dirpath, dirs, files in os.walk(top):
            dirs[:] = [d for d in sorted(dirs) if judge(os.path.join(dirpath, d))]
            for name in sorted(files):
                judge(os.path.join(dirpath, name))
    return found


def filesystem_of(info: os.stat_result) -> int:
    """The filesystem an entry lies on (its device number)."""
    return info.st_dev


def fsync_tree(folder: str) -> None:
    """Every file's bytes, then every directory's entries, on disk before the rename that publishes them."""
    for dirpath, _, filenames in os.walk(folder, topdown=False):
        for filename in filenames:
            path = os.path.join(dirpath, filename)
            if not os.path.islink(path):
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        _fsync_dir(dirpath)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # platforms that cannot open a directory (Windows) cannot fsync one either
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _swap_in(tmp: str, folder: str) -> None:
    """Make `tmp` the folder, with SIGINT/SIGTERM held until the renames are done. Afterwards `tmp` holds the
    previous version (or nothing) for the caller to remove."""
    held = {signal.SIGINT, signal.SIGTERM}
    blocked = hasattr(signal, "pthread_sigmask")
    if blocked:
        signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        cwd_inside = _inside(os.getcwd(), folder)
        if not os.path.isdir(folder):
            os.rename(tmp, folder)
        elif not _exchange(tmp, folder):
            # No atomic exchange here (not Linux, or a filesystem without it): two renames. A kill between them
            # leaves the previous version as .<name>.old-*, which _remove_leftovers puts back.
            old = os.path.join(
                os.path.dirname(folder), f".{os.path.basename(folder)}{_OLD}{os.getpid()}-{os.urandom(4).hex()}"
            )
            os.rename(folder, old)
            os.rename(tmp, folder)
            os.rename(old, tmp)
        _fsync_dir(os.path.dirname(folder))
        if cwd_inside:
            os.chdir(cwd_inside)  # our working directory was inside the previous version; follow the name
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, held)  # a signal that came meanwhile is delivered now


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: str, b: str) -> bool:
    """Swap the two paths in one step with Linux's renameat2(RENAME_EXCHANGE); False where that is unavailable."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"Could not put {a} in place of {b}: {os.strerror(code)}")


def _inside(path: str, folder: str) -> str | None:
    """`path` if it lies inside `folder` (or is it), else None."""
    path = os.path.abspath(path)
    return path if path == folder or path.startswith(folder + os.sep) else None


def _remove_leftovers(parent: str, name: str) -> None:
    """What a killed writer of `<parent>/<name>` left: its temporary folders are removed; a previous version
    caught between two renames is put back if the folder itself is missing. Folders of live processes stay, and
    so does the staging folder of a live run (this process's too)."""
    folder = os.path.join(parent, name)
    staging = staging_folder(folder)
    if os.path.isdir(staging) and not os.path.islink(staging) and not process_alive(_staging_owner(staging)):
        shutil.rmtree(staging, ignore_errors=True)
    for entry in sorted(os.listdir(parent)):
        for marker in (_PARTIAL, _OLD):
            prefix = f".{name}{marker}"
            if not entry.startswith(prefix):
                continue
            pid = entry[len(prefix) :].split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and process_alive(int(pid)):
                continue
            path = os.path.join(parent, entry)
            if marker == _OLD and not os.path.exists(folder):
                os.rename(path, folder)
            else:
                shutil.rmtree(path, ignore_errors=True)


# ---- a run that replaces a run (--overwrite): built beside it, swapped in by its export ----------------------


def staging_folder(folder: str | os.PathLike) -> str:
    """Where a run that replaces the run in `folder` works: `<parent>/.<name>.overwrite`, on the same filesystem
    (so its export can link it into the new version). One name, known to every process of a distributed run;
    one run at a time may use it, the one that holds `folder`'s run lock."""
    folder = os.path.abspath(folder)
    parent, name = os.path.split(folder)
    return os.path.join(parent, f".{name}{_STAGING}")


def start_staging(folder: str | os.PathLike) -> str:
    """Make `folder`'s staging folder afresh (what a killed run left there goes; the caller holds the run lock)
    and record this process as its owner; returns it."""
    staging = staging_folder(folder)
    if os.path.islink(staging):
        os.remove(staging)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    with open(os.path.join(staging, _OWNER), "w") as f:
        f.write(f"{os.getpid()}\n")
    return staging


def end_staging(folder: str | os.PathLike) -> None:
    """Remove `folder`'s staging folder: its run was exported (its files now live in `folder`) or stopped (the
    old run in `folder` was never touched)."""
    shutil.rmtree(staging_folder(folder), ignore_errors=True)


def _staging_owner(staging: str) -> int:
    try:
        with open(os.path.join(staging, _OWNER)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists on this machine (under any user)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
