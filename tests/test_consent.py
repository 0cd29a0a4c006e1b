"""Consent before code: no command but `deriv check` runs the Python files a folder carries.

A folder's `modeling_deriv.py` is planted with code that writes a marker file when imported. Deriv's model types
are registered with the Auto classes, so Deriv's folders load through the installed classes; a folder of another
type is refused unless the user passes --trust-remote-code.
"""

import json
import shutil
from pathlib import Path

import pytest
from conftest import cli_error, make_model

from deriv_lm.cli import main


NUMBERS = Path(__file__).parent / "data" / "numbers_lm"  # for its tokenizer files


@pytest.fixture
def planted(tmp_path) -> tuple[Path, Path]:
    """A Deriv folder whose every copied .py file writes `marker` when it is imported."""
    folder, marker = tmp_path / "folder", tmp_path / "marker"
    make_model(vocab_size=300).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(NUMBERS / name, folder / name)
    code = sorted(folder.glob("*.py"))
    assert code and json.loads((folder / "config.json").read_text())["auto_map"]  # the attack surface is there
    for path in code:
        path.write_text(f"open({str(marker)!r}, 'w').write('ran')\n" + path.read_text())
    return folder, marker


COMMANDS = [
    ["generate", "{folder}", "5 3", "--max-new-tokens", "2", "--no-stream"],
    ["eval", "{folder}", "--files", "{text}", "--max-tokens", "20"],
    ["attention", "{folder}", "5 3", "--out", "{tmp}/a.png"],
    ["picture", "temperature", "{folder}", "5 3", "--out", "{tmp}/t.png"],
    ["picture", "tokens", "{folder}", "5 3", "--out", "{tmp}/k.png"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_a_deriv_folder_loads_with_the_installed_classes_and_its_code_never_runs(planted, tmp_path, command):
    folder, marker = planted
    (tmp_path / "text.txt").write_text("5 3 1 8 : five thousand three hundred eighteen\n" * 5)
    argv = [a.format(folder=folder, text=tmp_path / "text.txt", tmp=tmp_path) for a in command]
    assert main(argv) == 0
    assert not marker.exists()


@pytest.mark.parametrize("command", COMMANDS[:4], ids=lambda c: " ".join(c[:2]))
def test_a_folder_of_another_type_is_refused_without_consent(planted, tmp_path, capsys, command):
    folder, marker = planted
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "not_deriv"  # its auto_map still points at the planted files
    (folder / "config.json").write_text(json.dumps(config))
    (tmp_path / "text.txt").write_text("5 3\n")
    argv = [a.format(folder=folder, text=tmp_path / "text.txt", tmp=tmp_path) for a in command]
    assert "--trust-remote-code" in cli_error(argv, capsys)
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.upstream
def test_check_does_run_the_folder_code_as_its_help_says(planted, capsys):
    folder, marker = planted
    main(["check", str(folder)])
    assert marker.exists()
