"""One run per output folder: a lock file holding the process id and host of the run that writes there.

Two runs into one `--output-dir` would interleave checkpoints and metrics. The main process takes the lock
before any work; a second run stops at once, naming the first. A lock whose process is gone (killed, the
machine rebooted) is taken over. The file is removed when the task's train function returns
(`releases_run_lock`), or at the latest when the process exits.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import socket

from ..folder.atomic import process_alive


LOCK_FILE = ".deriv-run.lock"
_created: set[str] = set()  # output folders this process made when it took their lock


def acquire_run_lock(output_dir: str, say=print) -> str:
    """Take the lock of `output_dir` for this process; raise ValueError if a live run holds it."""
    if not os.path.isdir(output_dir):
        os.makedirs(output_dir)
        _created.add(os.path.abspath(output_dir))
    path = os.path.join(output_dir, LOCK_FILE)
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    try:
        with open(path, encoding="utf-8") as f:
            holder = json.load(f)
    except FileNotFoundError:
        holder = None
    except (OSError, ValueError):
        holder = {}  # torn by a kill while it was written: nobody holds it
    if holder and holder.get("pid") != me["pid"]:
        pid, host = holder.get("pid"), holder.get("host")
        if host != me["host"]:
            raise ValueError(
                f"{output_dir} is in use by a run on {host} (pid {pid}); if that run is gone, delete {path}"
            )
        if isinstance(pid, int) and process_alive(pid):
            raise ValueError(
                f"{output_dir} is in use by another run (pid {pid}); wait for it to finish, or use another "
                "--output-dir"
            )
        say(f"taking over {path}: the run that held it (pid {pid}) is gone")
    tmp = f"{path}.{me['pid']}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(me, f)
    os.replace(tmp, path)
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


def release_run_lock(output_dir: str) -> None:
    """Remove this process's lock; and the folder too if taking the lock created it and the run left it empty
    (a run refused before any work leaves nothing behind)."""
    path = os.path.join(output_dir, LOCK_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            if json.load(f).get("pid") == os.getpid():
                os.remove(path)
    except (OSError, ValueError):
        pass
    folder = os.path.abspath(output_dir)
    if folder in _created:
        _created.discard(folder)
        try:
            os.rmdir(folder)  # only if empty
        except OSError:
            pass
