"""May Deriv write this folder? One answer for every command that writes one (train, export, import, quantize,
tokenizer), asked by `atomic_directory` and, earlier and naming the flag, by each command.

A command given `--output-dir DIR` (or `--out DIR`) replaces DIR's files with its own, and `--overwrite` replaces
the whole run. Pointed at the wrong place (`/`, `~`, `.`, a project folder), that is the worst a tool can do, so:

- **Never**: the filesystem root, the home folder or a folder that holds it, a mount point (its name cannot be
  swapped, and a carry-over would copy a filesystem), or a symbolic link (the swap would replace the link, not the
  folder it names). The working directory or a folder that holds it, unless it is already a Deriv folder (a run
  resumed from inside it) or empty. No flag lifts these.
- **A Deriv folder** may be written: one with the marker `.deriv` that `atomic_directory` writes into every
  folder it makes (JSON: the top-level names Deriv wrote there), or, for folders written before the marker, one
  that shows a run (`checkpoints/step-N/`, a run.json with a run record's `schema_version` and `task`) or a
  Deriv model (config.json's `model_type`). An empty or missing folder is fine.
- **Any other folder that holds something** is the user's: refused unless they consent (`--allow-existing-files`),
  and even then Deriv writes beside their files, never over them: a name it would write that is already theirs
  is refused (`foreign_names`), and `--overwrite`, which replaces a Deriv run, never takes a foreign folder.

Inside a Deriv folder the marker tells Deriv's entries from the user's: `--overwrite` drops the former and keeps
the latter. A folder written before the marker existed is all Deriv's (as it was treated then). Names that start
with `.deriv` (the marker, the run lock) are Deriv's own.
"""

from __future__ import annotations

import json
import os
import re

from ..errors import UsageError
from .inside import entry_problem, read_bytes_inside


MARKER = ".deriv"  # {"written": [top-level names Deriv wrote]}; push and the card ignore dotfiles
_OWN = ".deriv"  # every name that starts so is Deriv's: the marker, the run lock (.deriv-run.lock)
_STEP = re.compile(r"^step-\d+$")


def home_folder() -> str | None:
    """The user's home folder, resolved; None where there is none."""
    home = os.path.expanduser("~")
    return os.path.realpath(home) if home != "~" and os.path.isabs(home) else None


def is_filesystem_root(real: str) -> bool:
    return os.path.dirname(real) == real


def is_mount_point(path: str) -> bool:
    return os.path.ismount(path)


def _holds(folder: str, path: str | None) -> bool:
    """Whether `path` is `folder` or lies below it (both resolved)."""
    return path is not None and (path == folder or path.startswith(folder.rstrip(os.sep) + os.sep))


def never_reason(folder: str | os.PathLike) -> str | None:
    """Why Deriv may never write `folder` as a whole, or None. Only existing folders can be one of these."""
    path = os.path.abspath(folder)
    if os.path.islink(path):
        return f"is a symbolic link (to {os.path.realpath(path)}); give the folder itself"
    if not os.path.isdir(path):
        return None
    real = os.path.realpath(path)
    if is_filesystem_root(real):
        return "is the filesystem root"
    if _holds(real, home_folder()):
        return "is your home folder" if real == home_folder() else "holds your home folder"
    if is_mount_point(path):
        return "is a mount point (a filesystem of its own)"
    if _holds(real, os.path.realpath(os.getcwd())) and os.listdir(path) and deriv_names(path) is None:
        return "is the working directory" if real == os.path.realpath(os.getcwd()) else "holds the working directory"
    return None


def _marker_names(folder: str) -> list[str] | None:
    """The names the marker says Deriv wrote, or None when there is no readable marker."""
    if entry_problem(folder, MARKER) or not os.path.isfile(os.path.join(folder, MARKER)):
        return None
    try:
        written = json.loads(read_bytes_inside(folder, MARKER, limit=1 << 20)).get("written")
    except (OSError, ValueError, AttributeError, UsageError):
        return None
    return [n for n in written if isinstance(n, str)] if isinstance(written, list) else None


def _json_inside(folder: str, name: str) -> dict:
    try:
        value = json.loads(read_bytes_inside(folder, name, limit=16 << 20))
    except (OSError, ValueError, UsageError):
        return {}
    return value if isinstance(value, dict) else {}


def _shows_deriv(folder: str) -> bool:
    """A folder Deriv wrote before the marker: a run's checkpoints, a run record, or a Deriv model's config."""
    from .load import DERIV_MODEL_TYPES

    checkpoints = os.path.join(folder, "checkpoints")
    if entry_problem(folder, "checkpoints", want="dir") is None and os.path.isdir(checkpoints):
        if any(_STEP.match(name) for name in os.listdir(checkpoints)):
            return True
    record = _json_inside(folder, "run.json")
    if "schema_version" in record and "task" in record:
        return True
    return _json_inside(folder, "config.json").get("model_type") in DERIV_MODEL_TYPES


def deriv_names(folder: str | os.PathLike) -> set[str] | None:
    """The top-level names of `folder` that Deriv wrote: all of them for a folder written before the marker,
    none for an empty one; None for a folder that is not Deriv's (or does not exist)."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder) or os.path.islink(folder):
        return None
    names = set(os.listdir(folder))
    if all(n.startswith(_OWN) for n in names):  # empty, or only Deriv's own (the lock of a run starting)
        return names
    marked = _marker_names(folder)
    if marked is not None:
        return {n for n in names if n in marked or n.startswith(_OWN)}
    return names if _shows_deriv(folder) else None


def foreign_names(folder: str | os.PathLike) -> list[str]:
    """The top-level entries of an existing folder that Deriv did not write (the user's), sorted."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        return []
    ours = deriv_names(folder) or set()
    return sorted(n for n in os.listdir(folder) if n not in ours and not n.startswith(_OWN))


def _listed(names: list[str], most: int = 5) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def check_target(
    folder: str | os.PathLike, flag: str = "--output-dir", allow_existing: bool = False, replace: bool = False
) -> None:
    """Refuse (UsageError, one line naming `flag` and the folder) to write `folder` where Deriv may not:
    never the places of `never_reason`; a folder that holds files Deriv did not write only with `allow_existing`
    (the user's consent, --allow-existing-files), and never to `replace` (--overwrite) such a folder."""
    path = os.fspath(folder)
    named = f"{flag} {path}" if flag else path
    why = never_reason(path)
    if why:
        raise UsageError(f"{named} {why}: deriv never writes a folder there; give a new folder inside it")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise UsageError(f"{named} exists and is not a folder; give a folder")
    if deriv_names(path) is not None or not os.path.isdir(path):
        return
    found = _listed(sorted(os.listdir(path)))
    if replace:
        raise UsageError(
            f"{named} is not a Deriv run (it holds {found}): --overwrite replaces a run Deriv wrote, never "
            "other files; give another folder"
        )
    if not allow_existing:
        raise UsageError(
            f"{named} is not empty and not a Deriv folder (it holds {found}); give a new or empty folder, or pass "
            "--allow-existing-files to write beside those files (none of them is replaced)"
        )


def check_no_collision(folder: str | os.PathLike, names, flag: str = "--output-dir") -> None:
    """Refuse if any of `names` (what a writer is about to write) is already in `folder` and not Deriv's."""
    taken = sorted(set(foreign_names(folder)) & set(names))
    if taken:
        raise UsageError(
            f"{flag} {os.fspath(folder)} holds {_listed(taken)}, which deriv did not write and would replace; "
            "move them away or give another folder"
        )


def mark(folder: str | os.PathLike, names, fresh: bool = False) -> None:
    """Record in `folder`'s marker that Deriv wrote `names` there: added to what it already says, or with
    `fresh`, instead of it. Replaced, never written into (an exported folder's marker may be a hard link to the
    previous version's)."""
    folder = os.fspath(folder)
    known = [] if fresh else _marker_names(folder) or (sorted(os.listdir(folder)) if _shows_deriv(folder) else [])
    written = sorted(n for n in set(known) | set(names) if not n.startswith(_OWN))
    path = os.path.join(folder, MARKER)
    if not fresh and written == sorted(set(_marker_names(folder) or ())):
        return  # it says so already: a run resumed leaves its folder as it was until it writes
    with open(path + ".partial", "w", encoding="utf-8") as f:
        json.dump({"written": written}, f)
        f.write("\n")
    os.replace(path + ".partial", path)
