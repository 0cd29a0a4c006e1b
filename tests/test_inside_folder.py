"""Nothing leaves its folder: `deriv push` (the dry run and the upload), `deriv check` and `load_folder` against a
table of planted trees (issue 50).

A complete model folder (tests/data/numbers_lm saved with its code files and a card, what `deriv push` accepts)
is copied and one entry of `PLANTINGS` (tests/hostile.py) is planted in it, at its top or in a subfolder `docs/`:
a link out to a file (a `notes.md` standing for a private key, a `config2.json` for the system's account list), a
link out that holds weights, a folder linked in from outside, a dangling link, a FIFO (a `notes.txt`; an
`extra.safetensors`, which hung the dry run and the upload), a socket; and at the top, the files a load reads
(config.json, run.json, generation_config.json, tokenizer.json, chat_template.jinja, model.safetensors,
adapter/) replaced by a link out or a FIFO. Each surface must refuse it in one line that names the entry, before
anything is opened, read or sent, and never hang: a link that stays inside the folder is accepted, and the
upload sends exactly the files the check listed (`allow_patterns`), nothing its own walk of the folder would add.

A command that failed to refuse a FIFO would block for ever opening it; `fifo_valve` (tests/hostile.py) keeps a
writer waiting on each planted FIFO, so such a command reads an end of file at once and the test fails instead
of hanging.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import cli_error
from hostile import DATA, PLACES, SUB, fifo_valve, model_folder, outside_folder, place_id, plant

from deriv_lm.cli import main


SURFACES = ("dry-run", "upload", "check", "load")


@pytest.fixture(scope="module")
def complete(tmp_path_factory) -> Path:
    """tests/data/numbers_lm as `deriv push` wants it: code files, auto_map, a card (the dry run passes)."""
    from deriv_lm.folder import missing_files, read_folder

    folder = model_folder(tmp_path_factory.mktemp("inside") / "lm")
    assert missing_files(read_folder(folder)) == []
    return folder


def planted(complete: Path, tmp_path: Path, kind: str, where: str) -> tuple[Path, str, str]:
    """A copy of the complete folder with one planting: (folder, the entry's relative path, the why)."""
    folder = tmp_path / "lm"
    shutil.copytree(complete, folder)
    entry, why = plant(folder, kind, where)
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
@pytest.mark.parametrize("kind, where", PLACES, ids=[place_id(k, w) for k, w in PLACES])
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


def test_the_card_is_never_written_through_a_planted_link(complete, tmp_path, capsys):
    """`write_card` (under `deriv card`, the export and the import) writes README.md.partial and renames it into
    place: a link planted under that name is replaced, never written through (the file it points to is left as it
    was). `deriv card` refuses the folder first, naming the link, as it refuses any entry push would."""
    from deriv_lm.hub_card import write_card

    folder = tmp_path / "lm"
    shutil.copytree(complete, folder)
    victim = outside_folder(folder) / "passwd"
    before = victim.read_bytes()
    (folder / "README.md.partial").symlink_to(victim)
    line = cli_error(["card", str(folder)], capsys)
    assert "README.md.partial" in line and "outside the folder" in line, line
    write_card(folder)
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
