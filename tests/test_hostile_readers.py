"""Every reader of a folder by name inherits the plantings (tests/hostile.py, issue 50): the commands that read a
folder and were not yet tried against them (`deriv card`, `deriv tokenizer show` and `stats`, `deriv picture
tokens` and `curves`, `deriv eval`, `deriv explore`, `deriv serve`) each get a copy of a complete model folder with
one entry of `hostile.PLANTINGS` planted at its top or in `docs/` (a link out to a key, to an account list, to
weights, a folder linked in, a dangling link, a FIFO, a socket, each file a load reads replaced by a link out or a
FIFO).

Each refuses it in one `deriv: error:` line naming the entry and what it is, exit 2, before it reads anything the
planting could stand for: no FIFO is opened (`fifo_valve` gives a reader that opens one an end of file instead of
a hang, and reports it), nothing is written (the folder is as it was, no picture appears beside it), nothing is
served. The unplanted folder passes every one of them, so each refusal is the planting's.

Before, `tokenizer show`, `tokenizer stats` and `picture tokens` read a tokenizer.json linked out of the folder and
opened one that was a FIFO (a hang), `picture curves` drew a metrics.jsonl from anywhere, `deriv card` wrote its
card into any such folder, `deriv serve` read a config.json linked out, and a config.json that was a FIFO was "no
config.json" to every command taking a model folder.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
from conftest import cli_error
from hostile import PLACES, fifo_valve, model_folder, place_id, plant

from deriv_lm.cli import main


# surface -> its command line; {folder} is the (planted) folder, {out} a file it would write beside the folder,
# {text} a small corpus beside it
SURFACES = {
    "card": ["card", "{folder}"],
    "tokenizer-show": ["tokenizer", "show", "{folder}", "5 3 1 8"],
    "tokenizer-stats": ["tokenizer", "stats", "{folder}", "--files", "{text}", "--sample-mb", "0.001"],
    "picture-tokens": ["picture", "tokens", "{folder}", "5 3 1 8", "--out", "{out}"],
    "picture-curves": ["picture", "curves", "{folder}", "--out", "{out}"],
    "eval": ["eval", "{folder}", "--files", "{text}", "--max-tokens", "20"],
    "explore": ["explore", "{folder}", "--device", "cpu"],
    "serve": ["serve", "{folder}", "--device", "cpu"],
}


@pytest.fixture(scope="module")
def complete(tmp_path_factory) -> Path:
    """`hostile.model_folder`, with the losses a run logs (what `picture curves` draws)."""
    folder = model_folder(tmp_path_factory.mktemp("readers") / "lm")
    logged = [{"step": 1, "tokens_seen": 64, "train_loss": 3.2}, {"step": 2, "tokens_seen": 128, "val_loss": 3.0}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in logged))
    return folder


@pytest.fixture
def no_server(monkeypatch):
    """`deriv serve` and `deriv explore` never serve here: they listen on a port the OS chooses, and a folder they
    failed to refuse ends the command instead of blocking it. Yields the addresses served."""
    from deriv_lm.serving import server

    served = []
    listen = server.listen

    def record(app, sock, level="warning"):
        served.append(sock.getsockname())
        sock.close()

    monkeypatch.setattr(server, "listen", lambda host, port: listen(host, 0))
    monkeypatch.setattr(server, "run_server", record)
    return served


def argv(surface: str, folder: Path, tmp_path: Path) -> list[str]:
    text = tmp_path / "corpus.txt"
    if not text.exists():
        text.write_text("5 3 1 8 : 1 3 5 8\n\n2 9 4 : 2 4 9\n")
    places = {"folder": str(folder), "out": str(tmp_path / "out.png"), "text": str(text)}
    return [part.format(**places) for part in SURFACES[surface]]


def snapshot(folder: Path) -> dict[str, object]:
    """Every entry below `folder`, links and special files unfollowed and unopened: a file's bytes, a link's
    target, the kind of anything else."""
    found: dict[str, object] = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                found[os.path.relpath(path, folder)] = os.readlink(path)
            elif stat.S_ISREG(mode):
                found[os.path.relpath(path, folder)] = Path(path).read_bytes()
            else:
                found[os.path.relpath(path, folder)] = stat.S_IFMT(mode)
    return found


@pytest.mark.parametrize("surface", list(SURFACES))
def test_the_unplanted_folder_passes_every_reader(complete, tmp_path, surface, no_server, capsys):
    folder = tmp_path / "lm"
    shutil.copytree(complete, folder)
    assert main(argv(surface, folder, tmp_path)) == 0, capsys.readouterr().err
    assert len(no_server) == (surface in ("explore", "serve"))


@pytest.mark.parametrize("surface", list(SURFACES))
@pytest.mark.parametrize("kind, where", PLACES, ids=[place_id(k, w) for k, w in PLACES])
def test_every_reader_refuses_each_planting_by_name_unopened_and_writes_nothing(
    complete, tmp_path, kind, where, surface, no_server, capsys
):
    folder = tmp_path / "lm"
    shutil.copytree(complete, folder)
    entry, why = plant(folder, kind, where)
    before, around = snapshot(folder), sorted(os.listdir(tmp_path))
    command = argv(surface, folder, tmp_path)
    with fifo_valve(folder) as opened:
        line = cli_error(command, capsys)
    assert opened == [], f"{surface} opened a planted FIFO: {opened}"
    assert entry in line and why in line, line
    assert "Traceback" not in line
    assert snapshot(folder) == before and sorted(os.listdir(tmp_path)) == sorted({*around, "corpus.txt"})
    assert no_server == []
