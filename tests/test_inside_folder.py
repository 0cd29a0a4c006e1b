"""Nothing leaves its folder: `deriv push` (the dry run and the upload), `deriv check` and `load_folder` against a
table of planted trees (issue 50).

A complete model folder (tests/data/numbers_lm saved with its code files and a card, what `deriv push` accepts)
is copied and one entry is planted in it, at its top or in a subfolder `docs/`: a link out to a file (a
`notes.md` standing for a private key, a `config2.json` for the system's account list), a link out that holds
weights, a folder linked in from outside, a dangling link, a FIFO (a `notes.txt`; an `extra.safetensors`, which
hung the dry run and the upload), a socket; and at the top, the files a load reads (config.json, run.json,
generation_config.json, tokenizer.json, chat_template.jinja, model.safetensors, adapter/) replaced by a link out
or a FIFO. Each surface must refuse it in one line that names the entry, before anything is opened, read or
sent, and never hang: a link that stays inside the folder is accepted, and the upload sends exactly the files
the check listed (`allow_patterns`), nothing its own walk of the folder would add.

A command that failed to refuse a FIFO would block for ever opening it; `fifo_valve` keeps a writer waiting on
each planted FIFO, so such a command reads an end of file at once and the test fails instead of hanging.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import cli_error

from deriv_lm.cli import main


DATA = Path(__file__).parent / "data"
SUB = "docs/"  # the subfolder plantings go into (a real folder, holding a real file)


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


@pytest.fixture(scope="module")
def complete(tmp_path_factory) -> Path:
    """tests/data/numbers_lm as `deriv push` wants it: code files, auto_map, a card (the dry run passes)."""
    from deriv_lm import DerivForCausalLM
    from deriv_lm.folder import missing_files, read_folder
    from deriv_lm.hub_card import write_card

    folder = tmp_path_factory.mktemp("inside") / "lm"
    DerivForCausalLM.from_pretrained(DATA / "numbers_lm").save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(DATA / "numbers_lm" / name, folder / name)
    write_card(folder)
    (folder / SUB).mkdir()
    (folder / SUB / "usage.md").write_text("how to use it\n")
    assert missing_files(read_folder(folder)) == []
    return folder


# ---- the plantings: each puts one entry at `where` ("" or SUB) and returns (its path, what the refusal says) ----


def _outside(folder: Path) -> Path:
    """A folder beside the model folder, holding what links out point to: a secret, an account list, weights."""
    out = folder.parent / "outside"
    if not out.exists():
        out.mkdir()
        (out / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nplanted\n")
        (out / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
        shutil.copy(folder / "model.safetensors", out / "model.safetensors")
        (out / "docs").mkdir()
        (out / "docs" / "secret.md").write_text("private\n")
    return out


LINK_OUT = "symbolic link that leads outside the folder"


def link_to_a_key(folder, where):
    (folder / where / "notes.md").symlink_to(_outside(folder) / "id_ed25519")
    return f"{where}notes.md", LINK_OUT


def link_to_the_accounts(folder, where):
    (folder / where / "config2.json").symlink_to(_outside(folder) / "passwd")
    return f"{where}config2.json", LINK_OUT


def link_to_weights(folder, where):
    (folder / where / "extra.safetensors").symlink_to(_outside(folder) / "model.safetensors")
    return f"{where}extra.safetensors", LINK_OUT


def folder_linked_in(folder, where):
    (folder / where / "more").symlink_to(_outside(folder) / "docs", target_is_directory=True)
    return f"{where}more", LINK_OUT


def dangling_link(folder, where):
    (folder / where / "notes.md").symlink_to(folder / "nowhere.md")
    return f"{where}notes.md", "leads nowhere"


def fifo_text(folder, where):
    os.mkfifo(folder / where / "notes.txt")
    return f"{where}notes.txt", "FIFO"


def fifo_weights(folder, where):
    os.mkfifo(folder / where / "extra.safetensors")
    return f"{where}extra.safetensors", "FIFO"


def a_socket(folder, where):
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
    def plant(folder, where):
        source = folder / name
        target = _outside(folder) / f"own-{name.replace('/', '-')}"
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
    return plant


def replaced_by_fifo(name: str):
    def plant(folder, where):
        (folder / name).unlink(missing_ok=True)
        os.mkfifo(folder / name)
        return name, "FIFO"

    plant.__name__ = f"{name}-fifo"
    return plant


def adapter_linked_in(folder, where):
    adapter = _outside(folder) / "adapter"
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
PLANTINGS = [(kind, "") for kind in [*ANYWHERE, *AT_THE_TOP]] + [(kind, SUB) for kind in ANYWHERE]
SURFACES = ("dry-run", "upload", "check", "load")


def planted(complete: Path, tmp_path: Path, kind: str, where: str) -> tuple[Path, str, str]:
    """A copy of the complete folder with one planting: (folder, the entry's relative path, the why)."""
    folder = tmp_path / "lm"
    shutil.copytree(complete, folder)
    entry, why = {**ANYWHERE, **AT_THE_TOP}[kind](folder, where)
    return folder, entry, why


@pytest.fixture
def no_network(monkeypatch):
    """A token is there, and every call a push would make to the Hub is recorded instead of made."""
    import huggingface_hub

    calls: list[tuple[str, dict]] = []

    def record(name):
        def call(self, *args, **kwargs):
            calls.append((name, kwargs))
            return f"https://huggingface.co/someone/x/commit/{name}"

        return call

    for name in ("create_repo", "create_branch", "upload_folder"):
        monkeypatch.setattr(huggingface_hub.HfApi, name, record(name))
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    return calls


@pytest.fixture
def no_check_process(monkeypatch):
    """`deriv check`'s fresh process, recorded instead of started: every step passes."""
    import subprocess

    started: list[str] = []

    def hub_user(code, workdir, timeout=300):
        started.append(code)
        lines = [json.dumps({"step": s, "ok": True, "detail": "stub"}) for s in ("config", "tokenizer", "model")]
        lines += [json.dumps({"step": s, "ok": True, "detail": "stub"}) for s in ("generate", "pipeline")]
        return subprocess.CompletedProcess([], 0, stdout="\n".join(lines) + "\n", stderr="")

    monkeypatch.setattr("deriv_lm.hub_card.check.run_as_hub_user", hub_user)
    return started


def refusal(surface: str, folder: Path, capsys) -> str:
    """The surface's one-line refusal of `folder` (a `deriv: error:` line, exit 2; load: the error's message)."""
    from deriv_lm.folder import load_folder

    if surface == "load":
        with pytest.raises(ValueError) as refused:
            load_folder(folder)
        return str(refused.value)
    argv = {
        "dry-run": ["push", str(folder), "--repo-id", "someone/x", "--dry-run"],
        "upload": ["push", str(folder), "--repo-id", "someone/x"],
        "check": ["check", str(folder)],
    }[surface]
    return cli_error(argv, capsys)


@pytest.mark.parametrize("surface", SURFACES)
@pytest.mark.parametrize("kind, where", PLANTINGS, ids=[f"{k}-{'sub' if w else 'top'}" for k, w in PLANTINGS])
def test_each_planted_entry_is_refused_by_name_before_anything_is_read_or_sent(
    complete, tmp_path, capsys, no_network, no_check_process, kind, where, surface
):
    folder, entry, why = planted(complete, tmp_path, kind, where)
    with fifo_valve(folder) as opened:
        line = refusal(surface, folder, capsys)
    assert opened == [], f"{surface} blocked on a FIFO: {opened}"
    assert "\n" not in line and "Traceback" not in line
    assert entry in line and why in line, line
    assert no_network == [] and no_check_process == [], "the folder went further than its check"


@pytest.mark.parametrize("where", ["", SUB], ids=["top", "sub"])
def test_a_link_that_stays_inside_is_accepted_and_the_upload_sends_exactly_the_checked_files(
    complete, tmp_path, capsys, no_network, no_check_process, where
):
    """`notes.md -> README.md` stays inside: every surface accepts it. The upload is given the checked list as
    `allow_patterns`; applied to what huggingface_hub's own walk finds (which follows links and would find the
    ignored files too), it keeps those files and no other."""
    from huggingface_hub.utils import filter_repo_objects

    from deriv_lm.folder import load_folder, read_folder, upload_list

    folder = tmp_path / "lm"
    shutil.copytree(complete, folder)
    (folder / where / "notes.md").symlink_to(Path("../README.md" if where else "README.md"))
    (folder / "checkpoints" / "step-0000001").mkdir(parents=True)  # kept for resuming, never sent
    (folder / "checkpoints" / "step-0000001" / "optimizer.pt").write_bytes(b"state")
    (folder / ".secret").write_text("hidden\n")
    (folder / "notes[1].md").write_text("a name with glob characters\n")  # sent as itself, not as a pattern
    assert main(["push", str(folder), "--repo-id", "someone/x", "--dry-run"]) == 0
    readme = (folder / "README.md").stat().st_size
    assert f"{where}notes.md" in capsys.readouterr().out
    assert main(["push", str(folder), "--repo-id", "someone/x"]) == 0
    (upload,) = [kwargs for name, kwargs in no_network if name == "upload_folder"]
    walked = [p.relative_to(folder).as_posix() for p in sorted(folder.glob("**/*")) if p.is_file()]
    sent = sorted(filter_repo_objects(walked, allow_patterns=upload["allow_patterns"]))
    listed = upload_list(read_folder(folder))
    assert sent == sorted(name for name, _ in listed) and (f"{where}notes.md", readme) in listed
    assert not any(n.startswith(("checkpoints/", ".")) for n in sent) and "notes[1].md" in sent
    assert main(["check", str(folder)]) == 0 and len(no_check_process) == 1
    assert load_folder(folder).model.config.model_type == "deriv"


def _index(folder: Path, weight_map: dict) -> None:
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("surface", ["dry-run", "upload", "check"])
def test_an_index_naming_a_shard_outside_is_refused_not_reported_complete(
    complete, tmp_path, capsys, no_network, no_check_process, surface
):
    """A folder with no weights of its own, whose index names `../../x.safetensors`."""
    folder = tmp_path / "lm"
    shutil.copytree(complete, folder)
    (folder / "model.safetensors").unlink()
    _index(folder, {"model.embed_tokens.weight": "../../x.safetensors"})
    line = refusal(surface, folder, capsys)
    assert "model.safetensors.index.json" in line and "a path outside the folder" in line, line
    assert no_network == [] and no_check_process == []


@pytest.mark.parametrize("surface", ["dry-run", "check", "load"])
def test_a_config_nested_too_deeply_is_one_line(complete, tmp_path, capsys, no_network, no_check_process, surface):
    folder = tmp_path / "lm"
    shutil.copytree(complete, folder)
    (folder / "config.json").write_text('{"model_type": "deriv", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    line = refusal(surface, folder, capsys)
    assert "config.json" in line and "nested too deeply" in line, line


def test_the_valve_releases_and_reports_a_reader(tmp_path):
    """The guard itself: a reader of a planted FIFO gets an end of file instead of waiting, and is reported, even
    one that holds the GIL while it waits (safetensors)."""
    from safetensors import SafetensorError, safe_open

    os.mkfifo(tmp_path / "pipe.safetensors")
    with fifo_valve(tmp_path) as opened:
        assert (tmp_path / "pipe.safetensors").read_bytes() == b""
        with pytest.raises((SafetensorError, OSError)):  # mapping a FIFO fails, once it is open
            safe_open(str(tmp_path / "pipe.safetensors"), "pt")
    assert opened == [str(tmp_path / "pipe.safetensors")]
    with fifo_valve(tmp_path / "nothing-planted") as opened:
        pass
    assert opened == []


def test_the_card_is_never_written_through_a_planted_link(complete, tmp_path):
    """`deriv card` writes README.md.partial and renames it into place: a link planted under that name is replaced,
    never written through (the file it points to is left as it was)."""
    folder = tmp_path / "lm"
    shutil.copytree(complete, folder)
    victim = _outside(folder) / "passwd"
    before = victim.read_bytes()
    (folder / "README.md.partial").symlink_to(victim)
    assert main(["card", str(folder)]) == 0
    assert victim.read_bytes() == before and not (folder / "README.md.partial").exists()
    assert (folder / "README.md").read_text().startswith("---\n")


@pytest.mark.parametrize("kind", ["link-out", "fifo"])
def test_a_training_tokenizer_folder_with_a_planted_entry_is_refused_before_it_is_read(kind, tmp_path, capsys):
    """`deriv train lm --tokenizer DIR` (and a resumed run's `tokenizer/`, the same call) reads the folder through
    transformers: a tokenizer_config.json that is a link out or a FIFO is refused by name, and nothing is written."""
    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DATA / "numbers_lm" / name, folder / name)
    planted_name = "tokenizer_config.json"
    (folder / planted_name).unlink()
    if kind == "link-out":
        secret = tmp_path / "secret.json"
        secret.write_text("{}")
        (folder / planted_name).symlink_to(secret)
    else:
        os.mkfifo(folder / planted_name)
    out = tmp_path / "out"
    argv = ["train", "lm", "--tokenizer", str(folder), "--output-dir", str(out), "--max-steps", "1", "--cpu"]
    with fifo_valve(folder) as opened:
        line = cli_error([*argv, "--no-progress"], capsys)
    assert planted_name in line and ("link" in line or "FIFO" in line), line
    assert not opened
    assert not out.exists()
