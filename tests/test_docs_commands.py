"""The `deriv` lines in the pages' ```bash blocks parse with deriv's own parser, and each file they read exists in
the repository or is made first: by an earlier line of the page, by the README's tour (which the pages build on),
or is one of the reader's own files that the page names as such (`YOURS`).

Lines are read as a reader would paste them: continuation lines joined, comments dropped; `deriv` after a pipe
(`printf ... | deriv chat`) and `-m deriv_lm.cli` after a launcher (`accelerate launch`, `torchrun`) count too."""

from __future__ import annotations

import glob
import re
import shlex
from pathlib import Path

import pytest

from deriv_lm.cli import parse_args


ROOT = Path(__file__).parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))

# Lines shown as a synopsis, not a command: they do not parse as written, on purpose.
SYNOPSES = {"deriv push runs/deriv-tiny --repo-id you/deriv-tiny [--private] [--revision BRANCH]"}
# The reader's own files, which a page names as the place for their data (no line could make them).
YOURS = {
    "chats.jsonl": "chat.md: your conversations",
    "pairs.tsv": "translation.md: your sentence pairs",
    "test.tsv": "translation.md: your separate test pairs",
    "docs.jsonl": "training.md: your documents, streamed",
    "saved_folder": "training.md: your saved dataset",
    "held_out.txt": "your held-out text, scored with --files",
    "my_text.txt": "your text (the README's tour writes one)",
    "notes/": "tokenizer.md: your notes folder",
    "*.jsonl": "tokenizer.md: your .jsonl files",
    "validation.jsonl": "results.md: the validation split a measured run wrote",
    "FOLDER": "results.md: a placeholder",
    "path/to/a/gpt2-or-marian-folder": "convert.md: a placeholder",
    "path/to/gpt2": "training.md: a placeholder",
    "/tmp/q/lm": "results.md: the measured run's folder",
    "run.yaml": "training.md: your config file (the page writes one further down)",
}
READS = ("files", "folder", "tokenizer", "init_from", "config")
WRITES = ("output_dir", "out")


def bash_lines(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        lines += [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return lines


def deriv_argv(line: str) -> list[str] | None:
    """The arguments after `deriv` (or `-m deriv_lm.cli`) on a line, comments dropped; None for other lines."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None  # a heredoc's body line
    for start, word in enumerate(words):
        if word == "deriv" and (start == 0 or words[start - 1] == "|"):
            return words[start + 1 :]
        if word == "deriv_lm.cli" and start > 0 and words[start - 1] == "-m":
            return words[start + 1 :]
    return None


def paths(namespace, names) -> list[str]:
    found = []
    for name in names:
        value = getattr(namespace, name, None)
        if isinstance(value, str):
            found.append(value)
        elif isinstance(value, list):
            found += [v for v in value if isinstance(v, str)]
    return found


def made_by_shell(line: str) -> list[str]:
    """Files a shell line writes with `>` (`cat > run.yaml <<EOF`, `python -m pydoc builtins > my_text.txt`)."""
    return re.findall(r"(?<![<>2&])>\s*([\w./-]+)", line)


def outputs(lines: list[str]) -> set[str]:
    made: set[str] = set()
    for line in lines:
        made.update(made_by_shell(line))
        argv = deriv_argv(line)
        if argv and line not in SYNOPSES:
            made.update(paths(parse_args(argv), WRITES))
    return made


def tour() -> set[str]:
    return outputs(re.findall(r"(?m)^.*$", "\n".join(bash_lines(ROOT / "README.md"))))


def exists(path: str, made: set[str]) -> bool:
    path = path.rstrip("/") or path
    if path in YOURS or path + "/" in YOURS or glob.glob(str(ROOT / path)):
        return True
    return any(path == m.rstrip("/") or path.startswith(m.rstrip("/") + "/") for m in made)


@pytest.mark.parametrize("page", [p for p in PAGES if bash_lines(p)], ids=lambda p: p.name)
def test_every_deriv_line_parses_and_reads_what_exists_or_was_made(page, capsys, tmp_path, monkeypatch):
    # subtle: in a copy of the checkout's top level without what runs write (as on a fresh clone): a folder
    # argument is checked as the line is parsed, and `runs/x` counts as a local path where a `runs/` folder is
    # present (the checkout's own, after `make train`)
    for entry in ROOT.iterdir():
        if entry.name not in ("runs", "tiny-deriv", "tiny-deriv-mt"):
            (tmp_path / entry.name).symlink_to(entry)
    monkeypatch.chdir(tmp_path)
    made = tour()
    problems = []
    for line in bash_lines(page):
        made.update(made_by_shell(line))
        argv = deriv_argv(line)
        if argv is None or line.split("#")[0].strip() in SYNOPSES:
            continue
        try:
            namespace = parse_args(argv)
        except SystemExit:
            error = capsys.readouterr().err.strip()
            if not any(f"{path}: no such" in error for path in YOURS):  # the parser looks for a reader's folder
                problems.append(f"does not parse: {line}\n    {error}")
            continue
        for path in paths(namespace, READS):
            if not exists(path, made):
                problems.append(f"reads {path}, which neither exists nor is made before: {line}")
        made.update(paths(namespace, WRITES))
    assert not problems, f"docs/{page.name}:\n" + "\n".join(problems)


def test_a_bad_line_is_caught(capsys):
    with pytest.raises(SystemExit):
        parse_args(["train", "lm", "--no-such-flag"])
    assert not exists("runs/never-made", {"runs/deriv-tiny"}) and exists(
        "runs/deriv-tiny/tokenizer", {"runs/deriv-tiny"}
    )
    assert deriv_argv("printf 'hi\\n' | deriv chat runs/x  # piped") == ["chat", "runs/x"]
    assert deriv_argv("accelerate launch -m deriv_lm.cli train lm --cpu") == ["train", "lm", "--cpu"]
    assert made_by_shell("cat > run.yaml <<EOF") == ["run.yaml"]
