"""The hostile kinds every new surface inherits: what a folder may hold that is not what its name says, where a
writer must never write, and the mix of sampling settings an endpoint must serve (issue 50).

Each kind was found once by trying a surface as a hostile user would, and is kept here, importable from any test
(`from hostile import plant, PLANTINGS`), so the next reader, writer or sampling endpoint is tried against all of
them from its first test instead of after the next sweep:

- `PLANTINGS` (with `plant`, `PLACES`, `model_folder`): one entry planted in a model folder, at its top or in a
  subfolder: a link out to a key, to an account list, to weights, a folder linked in, a dangling link, a FIFO, a
  socket, and each file a load reads replaced by a link out or a FIFO. A reader of a folder by name refuses each
  in one line naming the entry, before anything is opened, and never hangs (`fifo_valve`).
- `foreign_folder`, `earlier_run`, `NEVER_WRITTEN` (with `never_place`): a folder of the user's, a Deriv run, and
  the places no writer takes over whatever the flags (the root, the home folder, the working directory, a mount
  point, a link), simulated in a temporary folder: nothing real is touched.
- `SAMPLING_SETTINGS` (with `sampling_setting`, `generate_setting`): fifty distinct sampling settings, as an
  OpenAI-style request's fields and as `generate()`'s arguments; a compiled graph that took them as constants
  failed for good after eight.

The tables of spoiled weights and sharded indexes (a pickle, a missing tensor, an index naming `../x`, a NUL,
a FIFO index...) stay with the load paths they were written for: `SPOILS` in tests/test_load_paths.py.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
from contextlib import contextmanager
from pathlib import Path


DATA = Path(__file__).parent / "data"
SUB = "docs/"  # the subfolder plantings go into (a real folder, holding a real file)
LINK_OUT = "symbolic link that leads outside the folder"


# ---- a FIFO never hangs a test ---------------------------------------------------------------------------------

# A writer for each planted FIFO, waiting in its own process: a reader that opens one gets an end of file at once
# and is recorded, where it would otherwise wait for ever. subtle: a process, not a thread, as some readers block
# in open() holding the GIL (safetensors' safe_open does), which would stop a thread of the test from running.
_WRITERS = 'm=$1; shift; for f in "$@"; do (while :; do : 3>"$f"; echo "$f" >> "$m"; sleep 0.1; done) & done; wait'


@contextmanager
def fifo_valve(folder):
    """Guard a call that must never open a FIFO planted in `folder` (a link is not followed): yields a list that,
    after the block, holds each FIFO a reader opened; empty when none was."""
    import signal
    import subprocess
    import tempfile

    fifos = []
    for root, _, names in os.walk(folder):
        fifos += [os.path.join(root, n) for n in names if stat.S_ISFIFO(os.lstat(os.path.join(root, n)).st_mode)]
    opened: list[str] = []
    if not fifos:
        yield opened
        return
    with tempfile.NamedTemporaryFile("r", suffix=".opened") as marker:
        writers = subprocess.Popen(["sh", "-c", _WRITERS, "sh", marker.name, *fifos], start_new_session=True)
        try:
            yield opened
        finally:
            os.killpg(writers.pid, signal.SIGKILL)
            writers.wait()
            opened += sorted(set(marker.read().split()))


# ---- what a folder may hold: the plantings ---------------------------------------------------------------------


def model_folder(folder: Path) -> Path:
    """tests/data/numbers_lm at `folder` as `deriv push` wants it (code files, auto_map, a card, a `docs/` holding
    a real file): every reader accepts it, so a refusal of a planted copy is the planting's."""
    from deriv_lm import DerivForCausalLM
    from deriv_lm.hub_card import write_card

    DerivForCausalLM.from_pretrained(DATA / "numbers_lm").save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DATA / "numbers_lm" / name, folder / name)
    write_card(folder)
    (folder / SUB).mkdir()
    (folder / SUB / "usage.md").write_text("how to use it\n")
    return folder


def outside_folder(folder: Path) -> Path:
    """A folder beside the planted one, holding what links out point to: a secret, an account list, weights."""
    out = folder.parent / "outside"
    if not out.exists():
        out.mkdir()
        (out / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nplanted\n")
        (out / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
        if (folder / "model.safetensors").is_file():
            shutil.copy(folder / "model.safetensors", out / "model.safetensors")
        else:  # a folder without weights (a tokenizer's): a file of that name all the same
            (out / "model.safetensors").write_bytes(b"weights of another folder")
        (out / "docs").mkdir()
        (out / "docs" / "secret.md").write_text("private\n")
    return out


def link_to_a_key(folder, where):
    """`notes.md` linked to a private key: pushed, it would publish the key."""
    (folder / where / "notes.md").symlink_to(outside_folder(folder) / "id_ed25519")
    return f"{where}notes.md", LINK_OUT


def link_to_the_accounts(folder, where):
    """`config2.json` linked to the system's account list."""
    (folder / where / "config2.json").symlink_to(outside_folder(folder) / "passwd")
    return f"{where}config2.json", LINK_OUT


def link_to_weights(folder, where):
    """`extra.safetensors` linked to weights elsewhere: a loader or a check would read its header."""
    (folder / where / "extra.safetensors").symlink_to(outside_folder(folder) / "model.safetensors")
    return f"{where}extra.safetensors", LINK_OUT


def folder_linked_in(folder, where):
    """`more/`, a folder of elsewhere linked in: every file below it is outside."""
    (folder / where / "more").symlink_to(outside_folder(folder) / "docs", target_is_directory=True)
    return f"{where}more", LINK_OUT


def dangling_link(folder, where):
    """`notes.md` linked to nothing: its name promises a file that is not there."""
    (folder / where / "notes.md").symlink_to(folder / "nowhere.md")
    return f"{where}notes.md", "leads nowhere"


def fifo_text(folder, where):
    """A FIFO `notes.txt`: opening it blocks until a writer comes."""
    os.mkfifo(folder / where / "notes.txt")
    return f"{where}notes.txt", "FIFO"


def fifo_weights(folder, where):
    """A FIFO `extra.safetensors`: it hung the push dry run and the upload."""
    os.mkfifo(folder / where / "extra.safetensors")
    return f"{where}extra.safetensors", "FIFO"


def a_socket(folder, where):
    """A Unix socket `notes.txt`: no file to read or publish."""
    # subtle: an AF_UNIX path is at most 108 bytes, which a test's temporary path can pass: bind relative to it
    here = os.getcwd()
    os.chdir(folder / where)
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind("notes.txt")
    finally:
        os.chdir(here)
    return f"{where}notes.txt", "socket"


# The files a load reads, replaced at the top of the folder (no subfolder variant: these names are read there).


def replaced_by_link(name: str):
    """`name` replaced by a link to a copy of it outside the folder (the same bytes, another folder's file)."""

    def plant(folder, where):
        source = folder / name
        target = outside_folder(folder) / f"own-{name.replace('/', '-')}"
        if source.is_dir():
            shutil.copytree(source, target)
            shutil.rmtree(source)
        elif source.exists():
            shutil.copy(source, target)
            source.unlink()
        else:  # a file the folder may hold (run.json, chat_template.jinja), planted as a link out
            target.write_text("{}")
        source.symlink_to(target, target_is_directory=target.is_dir())
        return name, LINK_OUT

    plant.__name__ = f"{name}-link-out"
    plant.__doc__ = f"{name} replaced by a link out of the folder."
    return plant


def replaced_by_fifo(name: str):
    """`name` replaced by a FIFO: a reader that opens it waits for ever."""

    def plant(folder, where):
        (folder / name).unlink(missing_ok=True)
        os.mkfifo(folder / name)
        return name, "FIFO"

    plant.__name__ = f"{name}-fifo"
    plant.__doc__ = f"{name} replaced by a FIFO."
    return plant


def adapter_linked_in(folder, where):
    """`adapter/`, the LoRA adapter a load applies, a folder of elsewhere linked in."""
    adapter = outside_folder(folder) / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (folder / "adapter").symlink_to(adapter, target_is_directory=True)
    return "adapter", LINK_OUT


ANYWHERE = {  # planted at the top and in docs/
    "link-to-a-key": link_to_a_key,
    "link-to-the-accounts": link_to_the_accounts,
    "link-to-weights": link_to_weights,
    "folder-linked-in": folder_linked_in,
    "dangling-link": dangling_link,
    "fifo-notes": fifo_text,
    "fifo-weights": fifo_weights,
    "socket": a_socket,
}
AT_THE_TOP = {  # what a load itself reads
    "weights-link-out": replaced_by_link("model.safetensors"),
    "config-link-out": replaced_by_link("config.json"),
    "config-fifo": replaced_by_fifo("config.json"),
    "run-link-out": replaced_by_link("run.json"),
    "generation-fifo": replaced_by_fifo("generation_config.json"),
    "tokenizer-link-out": replaced_by_link("tokenizer.json"),
    "tokenizer-fifo": replaced_by_fifo("tokenizer.json"),
    "tokenizer-config-fifo": replaced_by_fifo("tokenizer_config.json"),
    "template-link-out": replaced_by_link("chat_template.jinja"),
    "template-fifo": replaced_by_fifo("chat_template.jinja"),
    "adapter-linked-in": adapter_linked_in,
}
# kind -> planting: `planting(folder, where)` puts one entry at `where` ("" or SUB; the AT_THE_TOP kinds ignore
# it) and returns (the entry's path relative to the folder, the words the refusal gives for why)
PLANTINGS = {**ANYWHERE, **AT_THE_TOP}
# (kind, where) for every planting: each kind at the top, and those that may be anywhere in SUB too
PLACES = [(kind, "") for kind in PLANTINGS] + [(kind, SUB) for kind in ANYWHERE]


def place_id(kind: str, where: str) -> str:
    """A planting's test id: `fifo-notes-top`, `fifo-notes-sub`."""
    return f"{kind}-{'sub' if where else 'top'}"


def plant(folder: Path, kind: str, where: str = "") -> tuple[str, str]:
    """Plant one entry of `kind` in `folder` at `where`: (its path relative to the folder, why it is refused);
    a refusal names both."""
    return PLANTINGS[kind](Path(folder), where)


# ---- where a writer must never write --------------------------------------------------------------------------


def foreign_folder(folder: Path) -> Path:
    """A folder of the user's at `folder` (made if missing): a note and a subfolder of data, nothing Deriv wrote.
    A writer refuses it without explicit consent, and with it writes beside the user's files, never over them."""
    (folder / "data").mkdir(parents=True)
    (folder / "notes.txt").write_text("mine\n")
    (folder / "data" / "a.csv").write_text("1,2\n")
    return folder


def earlier_run(folder: Path) -> Path:
    """A Deriv run as an earlier version left it (no marker): a run record and a checkpoint."""
    (folder / "checkpoints" / "step-0000004").mkdir(parents=True)
    (folder / "checkpoints" / "step-0000004" / "COMPLETE").write_text("step 4\n")
    (folder / "run.json").write_text(json.dumps({"schema_version": 4, "task": "lm"}))
    (folder / "model.safetensors").write_bytes(b"old weights")
    return folder


# place -> the words of its refusal: no writer takes it over, whatever the flags
NEVER_WRITTEN = {
    "root": "is the filesystem root",
    "home": "is your home folder",
    "a folder holding home": "holds your home folder",
    "working directory": "is the working directory",
    "a folder holding the working directory": "holds the working directory",
    "mount point": "is a mount point",
    "link": "is a symbolic link",
}


def never_place(kind: str, tmp_path: Path, monkeypatch) -> Path:
    """A planted folder that plays `kind` of `NEVER_WRITTEN` (nothing real is touched: HOME set, the working
    directory changed, the root and mount checks of `deriv_lm.folder.target` patched): the user's files, and a
    run's too where that does not make it Deriv's (the working directory is refused as a folder of the user's)."""
    from deriv_lm.folder import target

    folder = foreign_folder(tmp_path / "place")
    (folder / "sub").mkdir()
    if "working directory" not in kind:
        earlier_run(folder)
    if kind == "root":
        monkeypatch.setattr(target, "is_filesystem_root", lambda real: real == str(folder.resolve()))
    elif kind in ("home", "a folder holding home"):
        monkeypatch.setenv("HOME", str(folder if kind == "home" else folder / "sub"))
    elif kind == "mount point":
        monkeypatch.setattr(target, "is_mount_point", lambda path: os.path.abspath(path) == str(folder))
    elif kind == "link":
        os.symlink(folder, tmp_path / "link")
        return tmp_path / "link"
    elif kind == "working directory":
        monkeypatch.chdir(folder)
    else:
        monkeypatch.chdir(folder / "sub")
    return folder


# ---- the mix of sampling settings -------------------------------------------------------------------------------


def sampling_setting(i: int) -> dict:
    """The i-th (i < 100) distinct sampling setting in an OpenAI-style request's fields: the seed, temperature
    and top_p vary, every third has a presence penalty and every fourth a frequency penalty, every tenth is greedy
    (temperature 0); every seventeenth asks for what the API refuses (temperature 2.5: a 400 naming the field)."""
    setting = {"seed": i, "temperature": round(0.02 + 0.0197 * i, 4), "top_p": round(1.0 - 0.0095 * i, 4)}
    if i % 3 == 0:
        setting["presence_penalty"] = round(-2.0 + 0.04 * i, 2)
    if i % 4 == 0:
        setting["frequency_penalty"] = round(2.0 - 0.04 * i, 2)
    if i % 10 == 9:
        setting["temperature"] = 0
    if i % 17 == 16:
        setting["temperature"] = 2.5
    return setting


# Fifty distinct settings, one after another or at once: a sampling endpoint answers each with a 200 or a 400
# naming the field, never a 500 (a compiled step that took them as constants died after eight).
SAMPLING_SETTINGS = [sampling_setting(i) for i in range(50)]


def generate_setting(i: int) -> dict:
    """The i-th distinct setting of generate(): every fifth greedy (penalties only), the others sampling with
    temperature, top-k, top-p, min-p and the three penalties (repetition, presence, frequency), each varying."""
    from transformers import LogitsProcessorList

    from deriv_lm.modeling_deriv import FrequencyPenaltyLogitsProcessor, PresencePenaltyLogitsProcessor

    penalties = LogitsProcessorList()
    if i % 3:
        penalties.append(PresencePenaltyLogitsProcessor(round(-1.5 + 0.06 * i, 3)))
    if i % 4:
        penalties.append(FrequencyPenaltyLogitsProcessor(round(1.2 - 0.05 * i, 3)))
    setting = {"repetition_penalty": 1.0 + 0.03 * i, "logits_processor": penalties}
    if i % 5 == 0:
        return {**setting, "do_sample": False, "pad_token_id": 0}
    sampled = {"temperature": 0.3 + 0.03 * i, "top_k": (7 * i) % 60, "top_p": 1.0 - 0.012 * i, "min_p": 0.002 * i}
    return {**setting, **sampled, "do_sample": True, "pad_token_id": 0}
