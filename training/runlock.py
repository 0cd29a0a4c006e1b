"""One run per output folder: an operating-system lock (filelock) on `OUTPUT_DIR/.deriv-run.lock`.

Two runs into one `--output-dir` would interleave checkpoints and metrics. The main process takes the lock
before any work; a second run stops at once, naming the folder. The operating system releases the lock when its
process ends, however it ends (killed, the machine rebooted), so a lock file a dead run left blocks nobody. The
file is removed when the task's train function returns (`releases_run_lock`), or at the latest when the process
exits.
"""

from __future__ import annotations

import atexit
import functools
import os

from filelock import FileLock, Timeout

from ..errors import UsageError
from ..folder.target import MARKER


LOCK_FILE = ".deriv-run.lock"
_held: dict[str, FileLock] = {}  # output folder -> the lock this process holds on it
_created: set[str] = set()  # output folders this process made when it took their lock


def acquire_run_lock(output_dir: str, say=print) -> str:
    """Take the lock of `output_dir` for this process; raise UsageError (a ValueError) if a live run holds it."""
    folder = os.path.abspath(output_dir)
    path = os.path.join(output_dir, LOCK_FILE)
    if folder in _held:
        return path
    if not os.path.isdir(output_dir):
        os.makedirs(output_dir)
        _created.add(folder)
    left_behind = os.path.exists(path)
    # subtle: thread_local=False, so that the thread that releases (atexit, a wrapper) need not be the one that took it
    lock = FileLock(path, timeout=0, thread_local=False)
    try:
        lock.acquire()
    except Timeout:
        raise UsageError(
            f"{output_dir} is in use by another run (it holds {path}); wait for it to finish, or use another "
            "--output-dir"
        ) from None
    if left_behind:
        say(f"taking over {path}: the run that held it is gone")
    _held[folder] = lock
    atexit.register(release_run_lock, output_dir)
    return path


def releases_run_lock(train):
    """For a task's train function: the lock its run took is released when it returns or fails, not only at
    interpreter exit (a notebook that trained into a folder must not keep other processes out of it)."""

    @functools.wraps(train)
    def wrapper(args, *more, **options):
        try:
            return train(args, *more, **options)
        finally:
            release_run_lock(args.output_dir)

    return wrapper


def holds_run_lock(output_dir: str) -> bool:
    """Whether this process holds the run lock of `output_dir`."""
    return os.path.abspath(output_dir) in _held


def release_run_lock(output_dir: str) -> None:
    """Remove this process's lock; and the folder too if taking the lock created it and the run left nothing in
    it but Deriv's marker (a run refused before any work leaves nothing behind)."""
    folder = os.path.abspath(output_dir)
    lock = _held.pop(folder, None)
    if lock is not None:
        # subtle: removed while still held, so that no other run locks the file in the instant before it goes;
        # Windows refuses to remove an open file, and there it goes after the release
        removed = _remove(lock.lock_file)
        lock.release(force=True)
        if not removed:
            _remove(lock.lock_file)
    if folder in _created:
        _created.discard(folder)
        try:
            if os.listdir(folder) == [MARKER]:
                os.remove(os.path.join(folder, MARKER))
            os.rmdir(folder)  # only if empty
        except OSError:
            pass


def _remove(path: str) -> bool:
    try:
        os.remove(path)
    except OSError:
        return False
    return True
