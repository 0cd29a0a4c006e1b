"""Where a command may write a folder (`folder/target.py`), and an interrupted `--overwrite` (issue 50).

A folder that holds files Deriv did not write is refused without `--allow-existing-files`, and with it those files
are kept and never replaced; `--overwrite` replaces a Deriv run only; the filesystem root, the home folder, the
working directory (or a folder that holds it) and a mount point are refused whatever the flags; the carry-over of
an existing folder takes no link out, FIFO, socket or entry of another filesystem. Every tree is planted in a
temporary folder: root, home and mount point are simulated (HOME set, `target`'s own tests patched), never real;
the folder of the user's, the run and the places never written are tests/hostile.py's, for every writer to come.

The slow tier interrupts `deriv train lm --overwrite` into a run at several points (data, training, after a
checkpoint, export, after the swap; SIGINT and SIGKILL): the folder is the old run byte for byte, or the new
one whole, never a mix.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import cli_error
from hostile import NEVER_WRITTEN, earlier_run, foreign_folder, never_place

from deriv_lm.errors import UsageError
from deriv_lm.folder import atomic, target
from deriv_lm.folder.atomic import atomic_directory, staging_folder
from deriv_lm.training.args import TrainingArguments
from deriv_lm.training.driver import check_output_dir


def snapshot(folder: Path) -> dict[str, object]:
    """Every entry below `folder`: a file's bytes and inode, a link's target, a folder's presence."""
    found: dict[str, object] = {}
    for dirpath, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, folder)
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                found[rel] = ("link", os.readlink(path))
            elif stat.S_ISREG(info.st_mode):
                found[rel] = (open(path, "rb").read(), info.st_ino)
            else:
                found[rel] = stat.S_IFMT(info.st_mode)
    return found


def train_args(folder, **flags) -> TrainingArguments:
    return TrainingArguments(output_dir=str(folder), **flags)


def refused(folder, **flags) -> str:
    with pytest.raises(UsageError) as refusal:
        check_output_dir(train_args(folder, **flags))
    return str(refusal.value)


def write_version(folder, name="config.json", **options) -> None:
    with atomic_directory(folder, **options) as tmp:
        Path(tmp, name).write_text("{}")


# ---- a folder of the user's ------------------------------------------------------------------------------------


def test_a_folder_of_the_users_is_refused_without_consent_and_left_as_it_was(tmp_path, capsys):
    folder = foreign_folder(tmp_path / "mine")
    before = snapshot(folder)
    assert "--allow-existing-files" in refused(folder) and "notes.txt" in refused(folder)
    line = cli_error(["train", "lm", "--output-dir", str(folder), "--max-steps", "1"], capsys)
    assert str(folder) in line and "not a Deriv folder" in line and "--allow-existing-files" in line
    line = cli_error(["tokenizer", "train", "--out", str(folder)], capsys)
    assert "--out" in line and "not a Deriv folder" in line
    with pytest.raises(UsageError, match="not a Deriv folder"):
        write_version(folder)
    assert snapshot(folder) == before
    assert sorted(os.listdir(tmp_path)) == ["mine"]  # nothing beside it either


def test_overwrite_never_takes_a_folder_of_the_users_even_with_consent(tmp_path, capsys):
    folder = foreign_folder(tmp_path / "mine")
    before = snapshot(folder)
    for flags in ({"overwrite": True}, {"overwrite": True, "allow_existing_files": True}):
        assert "--overwrite replaces a run Deriv wrote" in refused(folder, **flags)
    line = cli_error(["train", "lm", "--output-dir", str(folder), "--overwrite", "--allow-existing-files"], capsys)
    assert "is not a Deriv run" in line and "notes.txt" in line
    with pytest.raises(UsageError, match="not a Deriv run"):
        write_version(folder, replace=True, allow_existing=True)
    assert snapshot(folder) == before


def test_with_consent_deriv_writes_beside_the_users_files_and_never_over_them(tmp_path):
    folder = foreign_folder(tmp_path / "mine")
    check_output_dir(train_args(folder, allow_existing_files=True))  # allowed
    before = snapshot(folder)
    write_version(folder, "model.safetensors", allow_existing=True)
    after = snapshot(folder)
    assert {k: v for k, v in after.items() if k in before} == before  # same bytes, same files (inodes)
    assert json.loads((folder / ".deriv").read_text()) == {"written": ["model.safetensors"]}
    # the next version of what is now a Deriv folder: an --overwrite drops Deriv's files, keeps the user's
    write_version(folder, "config.json", replace=True)
    assert sorted(os.listdir(folder)) == [".deriv", "config.json", "data", "notes.txt"]
    assert {k: v for k, v in snapshot(folder).items() if k in before} == before
    # a writer that would replace a file of the user's is refused, and the folder is as it was
    kept = snapshot(folder)
    with pytest.raises(UsageError, match="notes.txt, which deriv did not write"):
        write_version(folder, "notes.txt")
    assert snapshot(folder) == kept and not [n for n in os.listdir(tmp_path) if n != "mine"]


def test_with_consent_a_run_that_would_replace_a_file_of_the_users_stops_before_any_work(tmp_path, capsys):
    folder = foreign_folder(tmp_path / "mine")
    (folder / "README.md").write_text("# my project\n")
    (folder / "metrics.jsonl").write_text("{}\n")
    before = snapshot(folder)
    message = refused(folder, allow_existing_files=True)
    assert "README.md" in message and "metrics.jsonl" in message and "would replace" in message
    (folder / "tokenizer.json").write_text("{}")
    line = cli_error(["tokenizer", "train", "--out", str(folder), "--allow-existing-files"], capsys)
    assert "tokenizer.json" in line and "would replace" in line
    before["tokenizer.json"] = snapshot(folder)["tokenizer.json"]
    assert snapshot(folder) == before


def test_a_run_is_a_deriv_folder_with_or_without_the_marker(tmp_path):
    """A run an earlier version wrote (no marker) is Deriv's: --overwrite and --resume take it; a run.json that is
    no run record does not make a folder Deriv's."""
    run = earlier_run(tmp_path / "run")
    check_output_dir(train_args(run, overwrite=True))
    check_output_dir(train_args(run, resume=True))
    assert "holds a run" in refused(run)
    other = tmp_path / "other"
    other.mkdir()
    (other / "run.json").write_text('{"runner": "mine"}')
    assert "not a Deriv folder" in refused(other)
    assert "not a Deriv run" in refused(other, overwrite=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    check_output_dir(train_args(empty))  # an empty folder is fine
    check_output_dir(train_args(empty, overwrite=True))


# ---- never: the root, the home folder, the working directory, a mount point ----------------------------------


@pytest.mark.parametrize("kind", list(NEVER_WRITTEN))
def test_the_root_home_working_directory_and_mount_points_are_never_written(kind, tmp_path, monkeypatch, capsys):
    folder = never_place(kind, tmp_path, monkeypatch)
    before = snapshot(folder)
    for flags in ({}, {"allow_existing_files": True}, {"overwrite": True}, {"resume": True}):
        assert NEVER_WRITTEN[kind] in refused(folder, **flags), flags
    line = cli_error(["train", "lm", "--output-dir", str(folder), "--allow-existing-files"], capsys)
    assert NEVER_WRITTEN[kind] in line and "deriv never writes a folder there" in line
    line = cli_error(["tokenizer", "train", "--out", str(folder), "--allow-existing-files"], capsys)
    assert NEVER_WRITTEN[kind] in line
    for options in ({"allow_existing": True}, {"replace": True}, {"carry_first": True}):
        with pytest.raises(UsageError, match=NEVER_WRITTEN[kind]):
            write_version(folder, **options)
    assert snapshot(folder) == before
    assert not [n for n in os.listdir(tmp_path) if ".partial-" in n]


def test_a_run_resumed_from_inside_its_own_folder_is_no_take_over(tmp_path, monkeypatch):
    """The working directory may be a Deriv folder: continuing the run you stand in takes over nothing."""
    run = earlier_run(tmp_path / "run")
    monkeypatch.chdir(run)
    check_output_dir(train_args(run, resume=True))
    check_output_dir(train_args(".", resume=True))


def test_export_import_and_quantize_refuse_a_folder_they_may_not_write(tmp_path, monkeypatch):
    """They write only a new folder (`_refuse_existing`, before any model is loaded), and never an empty mount
    point, the home folder or a link either; `atomic_directory` under them refuses the same."""
    from deriv_lm.convert.folders import import_gpt2
    from deriv_lm.convert.onnx import export_onnx
    from deriv_lm.convert.quantize import quantize_folder

    mine = foreign_folder(tmp_path / "mine")
    mount = tmp_path / "mount"
    mount.mkdir()
    os.symlink(tmp_path / "empty", tmp_path / "link")
    (tmp_path / "empty").mkdir()
    monkeypatch.setattr(target, "is_mount_point", lambda path: os.path.abspath(path) == str(mount))
    before = snapshot(tmp_path)
    nothing = str(tmp_path / "nothing")
    for write in (import_gpt2, export_onnx, quantize_folder):
        with pytest.raises(FileExistsError, match="already exists and is not empty"):
            write(nothing, mine)
        with pytest.raises(UsageError, match="--out .* is a mount point"):
            write(nothing, mount)
        with pytest.raises(UsageError, match="--out .* is a symbolic link"):
            write(nothing, tmp_path / "link")
    with pytest.raises(UsageError, match="is a mount point"):
        write_version(mount)
    monkeypatch.setenv("HOME", str(mount))
    with pytest.raises(UsageError, match="is your home folder"):
        quantize_folder(nothing, mount)
    assert snapshot(tmp_path) == before


# ---- the carry-over never leaves the folder ---------------------------------------------------------------------


def plant_entry(kind: str, where: Path, outside: Path) -> str:
    """A link out, a FIFO, a socket or (simulated) another filesystem's folder at `where/carried`."""
    path = where / "carried"
    if kind == "link out":
        os.symlink(outside, path)
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "socket":
        cwd = os.getcwd()
        os.chdir(where)  # a socket's path is limited to about 100 bytes: bind its bare name
        try:
            socket.socket(socket.AF_UNIX).bind("carried")
        finally:
            os.chdir(cwd)
    else:
        path.mkdir()
        (path / "big.bin").write_bytes(b"a filesystem of its own")
    return "carried"


CARRY = {
    "link out": "a symbolic link that leads outside the folder",
    "FIFO": "a FIFO",
    "socket": "a socket",
    "another filesystem": "on another filesystem",
}


@pytest.mark.parametrize("place", ["top", "subfolder"])
@pytest.mark.parametrize("kind", list(CARRY))
def test_the_carry_over_refuses_what_leaves_the_folder(kind, place, tmp_path, monkeypatch):
    outside = tmp_path / "secret"
    outside.write_text("private key\n")
    folder = tmp_path / "run"
    write_version(folder, "config.json")  # a Deriv folder
    where = folder / "checkpoints" if place == "subfolder" else folder
    where.mkdir(exist_ok=True)
    plant_entry(kind, where, outside)
    if kind == "another filesystem":
        planted = os.lstat(where / "carried").st_ino
        monkeypatch.setattr(atomic, "filesystem_of", lambda info: info.st_dev + (info.st_ino == planted))
    before = snapshot(folder)
    rel = os.path.relpath(where / "carried", folder)
    for options in ({}, {"carry_first": True}, {"replace": True}):
        with pytest.raises(UsageError, match=CARRY[kind]) as refusal:
            write_version(folder, "model.safetensors", **options)
        assert rel in str(refusal.value)
        assert snapshot(folder) == before
    assert sorted(os.listdir(tmp_path)) == ["run", "secret"]  # no temporary folder left, nothing copied out


def test_a_killed_overwrites_staging_folder_is_removed_by_the_next_writer_but_a_live_ones_stays(tmp_path):
    folder = tmp_path / "run"
    write_version(folder)
    staging = Path(staging_folder(folder))
    staging.mkdir()
    (staging / "metrics.jsonl").write_text("{}\n")
    (staging / ".deriv-staging").write_text(f"{os.getpid()}\n")  # a live run's (this process)
    write_version(folder)
    assert staging.is_dir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (staging / ".deriv-staging").write_text(gone.stdout)  # a run that was killed
    write_version(folder)
    assert not staging.exists()


# ---- the slow tier: real runs, interrupted --overwrite --------------------------------------------------------


@pytest.fixture(scope="module")
def old_run(tmp_path_factory, corpus_file):
    """A finished run (8 steps, checkpoints at 4 and 8) to overwrite."""
    from test_training import tiny_args

    from deriv_lm.training import train_lm

    args = tiny_args(tmp_path_factory.mktemp("old"), corpus_file, max_steps=8, save_every=4, eval_every=4)
    train_lm(args, cpu=True)
    return args


def overwrite_args(old_run, tmp_path, **changes) -> TrainingArguments:
    """A copy of the old run in `tmp_path/run`, and the arguments of a 6-step run that overwrites it."""
    import shutil

    shutil.copytree(old_run.output_dir, tmp_path / "run")
    values = {**old_run.to_dict(), "output_dir": str(tmp_path / "run"), "max_steps": 6, "save_every": 2}
    return TrainingArguments(**{**values, "overwrite": True, **changes})


def run_cli(args: TrainingArguments, patch: str = "") -> subprocess.CompletedProcess:
    from test_training import run_cli_with

    return run_cli_with(args, patch, "--overwrite")


def old_files(folder: str) -> dict:
    from test_training import files_of

    from deriv_lm.training.runlock import LOCK_FILE

    return files_of(folder, leave_out=(LOCK_FILE,))


def assert_wholly_new(folder: str) -> None:
    record = json.load(open(os.path.join(folder, "run.json")))
    assert record["training"]["steps"] == 6 and record["arguments"]["run"]["output_dir"] == "."
    assert sorted(os.listdir(os.path.join(folder, "checkpoints"))) == ["step-0000004", "step-0000006"]
    steps = [json.loads(line)["step"] for line in open(os.path.join(folder, "metrics.jsonl"))]
    assert steps == [2, 4, 6], steps
    assert "run" in open(os.path.join(folder, "README.md")).read()  # named after the folder, not the staging one
    assert ".overwrite" not in open(os.path.join(folder, "run.json")).read()


def at_step(step: int, signum: int) -> str:
    return (
        "import deriv_lm.training.trainer as target\noriginal = target.Trainer._after_step\n"
        "def patched(self, result):\n"
        f"    if self.state.step == {step - 1}:\n        os.kill(os.getpid(), {int(signum)})\n"
        "    return original(self, result)\n"
        "target.Trainer._after_step = patched"
    )


def after(module: str, function: str, signum: int, owner: str = "", when: str = "True") -> str:
    """Patch source: `module.[owner.]function` does its work, then sends `signum` to its own process (if `when`,
    an expression of its `args`, holds)."""
    holder = f"target.{owner}" if owner else "target"
    return (
        f"import {module} as target\noriginal = {holder}.{function}\n"
        "def patched(*args, **kwargs):\n    value = original(*args, **kwargs)\n"
        f"    if {when}:\n        os.kill(os.getpid(), {int(signum)})\n    return value\n"
        f"{holder}.{function} = patched"
    )


STOPS = {
    "SIGINT while preparing the data": "send:deriv_lm.training.lm:lm_datasets",
    "SIGINT during training": "step",
    "SIGINT after a checkpoint in the staging folder": "checkpoint",
    "SIGINT while exporting": "send:deriv_lm.training.export:write_card",
}


@pytest.mark.slow
@pytest.mark.parametrize("when", list(STOPS))
def test_an_interrupted_overwrite_leaves_the_old_run_whole(old_run, tmp_path, when):
    from test_training import leftovers, send_at

    args = overwrite_args(old_run, tmp_path)
    before = old_files(args.output_dir)
    how = STOPS[when]
    if how.startswith("send:"):
        patch = send_at(*how.split(":")[1:], signal.SIGINT)
    elif how == "step":
        patch = at_step(3, signal.SIGINT)
    else:
        patch = after("deriv_lm.training.checkpoints", "save", signal.SIGINT, owner="Checkpoints")
    done = run_cli(args, patch)
    assert done.returncode == 130, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert "SIGINT received" in done.stderr and "stopped" in done.stderr, done.stderr[-2000:]
    if how in ("step", "checkpoint"):
        assert f"{args.output_dir} holds the earlier run as it was" in done.stderr
    assert old_files(args.output_dir) == before  # weights, run.json, card, metrics, checkpoints: byte for byte
    assert leftovers(args.output_dir) == []  # the staging folder went with the stop


@pytest.mark.slow
def test_a_killed_overwrite_leaves_the_old_run_and_the_next_overwrite_replaces_it_whole(old_run, tmp_path):
    from test_training import leftovers

    args = overwrite_args(old_run, tmp_path)
    before = old_files(args.output_dir)
    done = run_cli(args, after("deriv_lm.training.checkpoints", "save", signal.SIGKILL, owner="Checkpoints"))
    assert done.returncode == -signal.SIGKILL
    assert old_files(args.output_dir) == before
    assert leftovers(args.output_dir) == [".run.overwrite"]  # the killed run's work, beside the old run

    done = run_cli(args)  # the next run takes the lock, starts its staging afresh, and swaps in whole
    assert done.returncode == 0, done.stderr[-3000:]
    assert_wholly_new(args.output_dir)
    assert leftovers(args.output_dir) == []


@pytest.mark.slow
def test_a_kill_right_after_the_swap_leaves_the_new_run_whole(old_run, tmp_path):
    from test_training import leftovers

    args = overwrite_args(old_run, tmp_path)
    swapped = f"args[1] == {args.output_dir!r}"  # the export's swap, not the tokenizer's
    done = run_cli(args, after("deriv_lm.folder.atomic", "_swap_in", signal.SIGKILL, when=swapped))
    assert done.returncode == -signal.SIGKILL
    assert_wholly_new(args.output_dir)
    assert leftovers(args.output_dir)  # the old version and the staging folder: gone at the next write
    from deriv_lm.folder.atomic import atomic_directory

    with atomic_directory(args.output_dir, carry_first=True):
        pass
    assert leftovers(args.output_dir) == []
    assert_wholly_new(args.output_dir)


@pytest.mark.slow
def test_ctrl_c_from_outside_as_the_new_run_logs_leaves_old_or_new_whole(old_run, tmp_path):
    """A real Ctrl-C, sent once the staging folder's metrics.jsonl appears: whatever moment it lands on."""
    import time

    from test_training import cli_flags, leftovers

    args = overwrite_args(old_run, tmp_path, max_steps=400, save_every=50, log_every=10)
    before = old_files(args.output_dir)
    code = "import signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
    code += "from deriv_lm.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    process = subprocess.Popen(
        [sys.executable, "-c", code, *cli_flags(args), "--overwrite"], stderr=subprocess.PIPE, text=True
    )
    metrics = Path(staging_folder(args.output_dir)) / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while process.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and metrics.stat().st_size:
            process.send_signal(signal.SIGINT)
            break
        time.sleep(0.05)
    _, err = process.communicate(timeout=240)
    if process.returncode == 130:
        assert old_files(args.output_dir) == before, err[-2000:]
    else:  # it finished before the signal landed
        assert process.returncode == 0, err[-3000:]
        record = json.load(open(os.path.join(args.output_dir, "run.json")))
        assert record["training"]["steps"] == 400
    assert "Traceback" not in err and leftovers(args.output_dir) == []


@pytest.mark.slow
def test_a_run_with_consent_keeps_the_users_files_through_training_and_overwrite(old_run, tmp_path):
    from test_training import tiny_args

    from deriv_lm.training import train_lm

    folder = foreign_folder(tmp_path / "mine")
    before = snapshot(folder)
    args = tiny_args(tmp_path, old_run.files[0], output_dir=str(folder), max_steps=4, save_every=4)
    args.allow_existing_files = True
    args.cache_dir = old_run.cache_dir
    train_lm(args, cpu=True)
    assert (folder / "model.safetensors").is_file()
    assert {k: v[0] for k, v in snapshot(folder).items() if k in before and isinstance(v, tuple)} == {
        k: v[0] for k, v in before.items() if isinstance(v, tuple)
    }
    again = TrainingArguments(**{**args.to_dict(), "allow_existing_files": False, "overwrite": True, "max_steps": 2})
    train_lm(again, cpu=True)
    assert json.load(open(folder / "run.json"))["training"]["steps"] == 2
    assert (folder / "notes.txt").read_text() == "mine\n" and (folder / "data" / "a.csv").read_text() == "1,2\n"
