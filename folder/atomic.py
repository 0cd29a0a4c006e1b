"""Writing folders so that an interruption never replaces a good one with a half-written one.

`atomic_directory(folder)` builds the folder's next version complete in a sibling temporary folder (same
parent, so same filesystem), fsyncs it, and swaps it in with one rename. A kill at any instant leaves the old
folder or the new one, never a mixture; what a killed writer left beside the folder is removed the next time
one is written there.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager


_PARTIAL = ".partial-"  # <parent>/.<name>.partial-<pid>-<random>: the next version, being written
_OLD = ".old-"  # <parent>/.<name>.old-<pid>-<random>: the previous version, between two renames (no renameat2)


@contextmanager
def atomic_directory(folder: str | os.PathLike, carry_first: bool = False) -> Iterator[str]:
    """Yield a temporary folder beside `folder`; on success the folder's new version replaces it whole.

    The new version is the old one's files (hard links, so a model folder's checkpoints cost nothing to
    carry) with what was written into the temporary folder on top: files already in `folder` that the new
    contents do not replace are kept (a tokenizer written into a model folder leaves the model's files alone).
    With `carry_first` the old files are linked in before the yield, for a writer that reads them (a card built
    from the folder): it must replace a file (`os.replace`), never write into it, which would change the old
    version through the shared link. On failure or a signal the temporary folder is removed and `folder` is
    untouched.
    """
    folder = os.path.abspath(folder)
    parent, name = os.path.split(folder)
    os.makedirs(parent, exist_ok=True)
    _remove_leftovers(parent, name)
    tmp = tempfile.mkdtemp(prefix=f".{name}{_PARTIAL}{os.getpid()}-", dir=parent)
    try:
        if carry_first and os.path.isdir(folder):
            _carry_over(folder, tmp)
        yield tmp
        if os.path.isdir(folder):
            _carry_over(folder, tmp)
        with_umask(tmp)
        fsync_tree(tmp)
        _swap_in(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # after a swap: the previous version, now under the temporary name


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


def _carry_over(folder: str, tmp: str) -> None:
    """Link every entry of `folder` that `tmp` does not already have into `tmp` (copy where links fail)."""

    def link_or_copy(source: str, target: str) -> None:
        try:
            os.link(source, target)
        except OSError:  # a filesystem without hard links
            shutil.copy2(source, target)

    for entry in os.listdir(folder):
        source, target = os.path.join(folder, entry), os.path.join(tmp, entry)
        if os.path.lexists(target):
            continue
        if os.path.islink(source):
            os.symlink(os.readlink(source), target)
        elif os.path.isdir(source):
            shutil.copytree(source, target, symlinks=True, copy_function=link_or_copy)
        else:
            link_or_copy(source, target)


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
    caught between two renames is put back if the folder itself is missing. Folders of live processes stay."""
    folder = os.path.join(parent, name)
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


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists on this machine (under any user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
