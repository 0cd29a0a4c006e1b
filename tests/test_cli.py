"""The `deriv` command itself: `deriv --help` without the heavy imports, each command's full help, the old
spellings of the benchmarks."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deriv_lm.cli import COMMANDS, main


ROOT = Path(__file__).parents[1]

# What the console script runs (`deriv = "deriv_lm_cli:main"`), reporting at exit which heavy modules it imported.
LAUNCHER = """
import atexit, sys
atexit.register(lambda: print("imported:", sorted({m.split(".")[0] for m in sys.modules} & {"torch", "transformers",
                                                   "deriv_lm"}), file=sys.stderr))
import deriv_lm_cli
sys.exit(deriv_lm_cli.main())
"""


def launch(*argv: str) -> subprocess.CompletedProcess:
    """`deriv ARGV` through the launcher, in a fresh interpreter (the source tree first on its path)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, "-c", LAUNCHER, *argv], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )


def test_help_lists_the_commands_without_importing_torch_or_transformers():
    result = launch("--help")
    assert result.returncode == 0, result.stderr
    assert "imported: []" in result.stderr
    for command in COMMANDS:
        listed = f"\n    {command.name} " in result.stdout or f"\n    {command.name}\n" in result.stdout
        assert listed == (command.help is not None), command.name  # the old spellings work but are not listed
    assert "bench-" not in result.stdout


def test_the_help_says_what_import_and_export_read_and_write():
    helps = {command.name: command.help for command in COMMANDS}
    assert all(name in helps["import"] for name in ("GPT-2", "Llama", "Marian"))
    assert all(name in helps["export"] for name in ("GPT-2", "Llama", "Marian", "ONNX", "CTranslate2", "GGUF"))


def test_train_help_spells_each_flag_with_dashes_first(capsys):
    with pytest.raises(SystemExit):
        main(["train", "lm", "--help"])
    out = capsys.readouterr().out
    assert "[--output-dir OUTPUT_DIR]" in out and "--output-dir OUTPUT_DIR, --output_dir OUTPUT_DIR" in out
    assert "--output_dir OUTPUT_DIR, --output-dir" not in out


@pytest.mark.parametrize("argv", [[], ["bogus"], ["--debug"]])
def test_a_missing_or_unknown_command_is_one_line_without_the_package(argv):
    result = launch(*argv)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("deriv: error: ") and lines[1] == "imported: []", result.stderr
    assert "bench-seq2seq" not in lines[0]  # an unknown command lists the commands, not the old spellings


@pytest.mark.slow
def test_a_command_runs_through_the_launcher():
    result = launch("bench", "seq2seq", "--beams", "0")
    assert result.returncode == 2
    assert result.stderr.startswith("deriv: error: argument --beams: must be an integer >= 1, got '0'")
    assert "(see `deriv bench seq2seq --help`)" in result.stderr


def test_a_command_shows_its_full_help(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["bench", "seq2seq", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: deriv bench seq2seq ")
    assert "--beam-repeats" in out and "MarianMTModel" in out
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--trust-remote-code" in capsys.readouterr().out


@pytest.mark.parametrize("old", ["bench-seq2seq", "bench-tokenizer", "bench-training"])
def test_the_old_bench_spellings_still_dispatch(old, monkeypatch):
    import importlib

    kind = old.removeprefix("bench-")
    module = importlib.import_module(f"deriv_lm.bench.{kind}")
    seen = []
    monkeypatch.setattr(module, "run", lambda args: seen.append(args) or 0)
    assert main([old]) == 0
    assert main(["bench", kind]) == 0
    assert len(seen) == 2 and vars(seen[0]).keys() - {"kind"} == vars(seen[1]).keys() - {"kind"}


# ---- what a failure means: bad input is one line, anything else is a bug with its traceback ----------------------


def _failing_bench(monkeypatch, error: Exception) -> None:
    """`deriv bench training` raises `error` where its work would start."""
    from deriv_lm.bench import training

    def run(args):
        raise error

    monkeypatch.setattr(training, "run", run)


def test_a_key_error_inside_a_command_is_a_bug_with_its_traceback(monkeypatch, capsys):
    _failing_bench(monkeypatch, KeyError("hidden_size"))
    assert main(["bench", "training"]) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):", err
    assert "KeyError: 'hidden_size'" in err
    assert lines[-1] == "deriv: this is a bug in deriv; please report it with the traceback above"
    assert "deriv: error:" not in err


def test_a_usage_error_is_one_line_and_status_2(monkeypatch, capsys):
    from deriv_lm.errors import UsageError

    _failing_bench(monkeypatch, UsageError("--steps 7: past the corpus"))
    assert main(["bench", "training"]) == 2
    assert capsys.readouterr().err == "deriv: error: --steps 7: past the corpus\n"


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_debug_shows_the_traceback_of_a_usage_error(how, monkeypatch, capsys):
    from deriv_lm.errors import UsageError

    _failing_bench(monkeypatch, UsageError("--steps 7: past the corpus"))
    if how == "environment":
        monkeypatch.setenv("DERIV_DEBUG", "1")
    with pytest.raises(UsageError, match="past the corpus") as raised:
        main(["--debug", "bench", "training"] if how == "flag" else ["bench", "training"])
    assert raised.traceback[-1].name == "run"  # the traceback reaches where it was raised
    assert "deriv: error:" not in capsys.readouterr().err


def test_a_missing_file_and_the_os_refusing_one_are_one_line(monkeypatch, capsys):
    from deriv_lm.errors import MissingFile

    for error in (MissingFile("--json out/x.json: the folder out does not exist"), PermissionError("out: denied")):
        _failing_bench(monkeypatch, error)
        assert main(["bench", "training"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("deriv: error: ") and "Traceback" not in err
