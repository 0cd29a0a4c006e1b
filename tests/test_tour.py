"""The README's shell commands run as written, in README order, in one scratch folder: what an earlier command
writes (runs/deriv-tiny, my_text.txt, ...) is what a later one reads, so a command naming a file that nothing makes
fails here.

The commands are read from README.md's ```bash blocks, so an edited README is what is tested. Each `deriv ...` line
runs with the small settings of `SMALL` appended (flags given later win) so the tour takes minutes, not the half
hour it takes as written; the lines that need a network, a second process group or an installer are in `INSTEAD`,
each with what the test does in their place and why. A line in neither table fails the test: a new README command
cannot go untested. The `deriv` lines run in this process (`deriv_lm.cli.main`), but for one, which runs the
installed `deriv` console script, and `deriv serve`, which is a server in a child process that the `curl` line
talks to."""

from __future__ import annotations

import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest


# the README's commands: trainings, a fine-tuning, a server in a child process
pytestmark = pytest.mark.slow


ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"

STEPS = "--max-steps 2 --warmup-steps 1 --eval-every 2 --save-every 2 --samples 1 --no-progress --cpu"
# Small settings per command, the first whose prefix the line starts with: they shrink the model, the run and
# the scoring, never what the line asks for (its data, its folders, its task). The language model keeps the
# tiny preset's context of 128, which the chat fine-tuning then takes from it (its conversations need that room).
SMALL: list[tuple[str, list[str]]] = [
    (prefix, shlex.split(flags))
    for prefix, flags in [
        ("deriv train lm --init-from", f"--context-length 32 --batch-size 4 --num-proc 1 {STEPS}"),
        (
            "deriv train lm",
            "--vocab-size 300 --hidden-size 32 --intermediate-size 64 --num-hidden-layers 1 --num-attention-heads 2"
            f" --batch-size 4 --max-documents 200 --eval-batches 1 --num-proc 1 {STEPS}",
        ),
        (
            "deriv train translation",
            "--vocab-size 300 --context-length 24 --hidden-size 32 --intermediate-size 64 --encoder-layers 1"
            " --decoder-layers 1 --encoder-attention-heads 2 --decoder-attention-heads 2 --batch-size 8"
            f" --num-beams 2 --bleu-pairs 4 {STEPS}",
        ),
        ("deriv train sft", f"--batch-size 4 --max-conversations 100 {STEPS}"),
        ("deriv generate", "--max-new-tokens 8"),
        ("deriv chat", "--max-new-tokens 8"),
        ("deriv translate", "--max-new-tokens 8"),
        ("deriv eval runs/deriv-translate-tiny", "--max-pairs 4"),
        ("deriv eval", "--max-tokens 256"),
    ]
]
# What a chat reads from its piped stdin.
CHAT_INPUT = "What does open() return?\nAnd close()?\n"

# The lines not run as written: what runs instead, and why.
INSTEAD: dict[str, tuple[str, str]] = {
    "make train": ("skip", "runs `deriv train lm`, the tour's first line, run here with small settings"),
    "make test": ("skip", "runs this suite"),
    "make setup": ("skip", "installs .venv; the suite runs in it"),
    "make setup && . .venv/bin/activate": (
        "activate",
        "make setup is the installer the suite already ran; the activation runs in a shell, and `deriv` must then be "
        "the environment's own command",
    ),
    'pip install -e ".[viz,serve,lora,quantize,marian]"': ("skip", "an installer; the suite's .venv has the extras"),
    'pip install -e ".[serve]"': ("skip", "an installer; the suite's .venv has the serve extra"),
    "accelerate launch --config_file training/accelerate_configs/cpu_fsdp.yaml -m deriv_lm.cli train lm --cpu"
    " --output-dir runs/fsdp": (
        "skip",
        "two processes for minutes; tests/test_distributed.py runs this config (test_fsdp_*)",
    ),
    "python -m pydoc builtins > my_text.txt": ("shell", "runs as written, with this Python"),
    "deriv push runs/deriv-tiny --repo-id you/deriv-tiny": (
        "skip",
        "network: uploads to the Hub (its --dry-run, the line before, lists the same upload)",
    ),
    "deriv serve runs/deriv-tiny --continuous-batching": ("serve", "a server in a child process, on a free port"),
    "curl": ("curl", "the same request, to that server, with the standard library's HTTP client"),
    "deriv explore runs/deriv-tiny": (
        "explore",
        "a server in a child process, on a free port, asked for its page and one analysis (tests/"
        "test_explore_browser.py drives the page in Chromium)",
    ),
    "deriv import gpt2 --out runs/gpt2-deriv": ("gpt2", "network: a tiny local GPT-2 checkpoint instead of `gpt2`"),
    "deriv import Helsinki-NLP/opus-mt-en-de --out runs/opus-en-de": (
        "marian",
        "network: a tiny local Marian checkpoint instead of the Hub's",
    ),
}
# The one line run through the installed `deriv` console script, in a child process.
CONSOLE_SCRIPT_LINE = "deriv generate"
# The extra each command needs; without it the line is skipped, saying so.
EXTRAS = {"deriv serve": "fastapi", "curl": "fastapi", "deriv explore": "fastapi", "deriv quantize": "torchao"}


def check_activation(line: str) -> str | None:
    """The line's activation, run as written after its `make setup &&` (the installer the suite already ran), in
    the checkout: then `deriv` is the environment's own command. Where the suite runs in another environment than
    the checkout's .venv (make test-newest's), there is no such script to run: the reason, and the line is
    listed as skipped."""
    activation = line.split("&&", 1)[1].strip()
    script = ROOT / activation.split()[1]
    if Path(sys.prefix).resolve() != script.parent.parent.resolve():
        return f"the suite runs in {sys.prefix}, not in the checkout's .venv, whose activation the README gives"
    found = subprocess.run(
        ["bash", "-c", f"{activation} && command -v deriv"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()).resolve() == (script.parent / "deriv").resolve(), found.stdout
    return None


def readme_commands(text: str) -> list[str]:
    """The shell lines of the ```bash blocks, continuation lines joined, comments and blank lines dropped."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                lines.append(strip_comment(line))
    return lines


def strip_comment(line: str) -> str:
    """The line without its trailing `# comment` (a `#` inside quotes is kept) and surrounding spaces."""
    quote = None
    for i, char in enumerate(line):
        if char in "'\"" and quote in (None, char):
            quote = None if quote else char
        elif char == "#" and quote is None and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip()
    return " ".join(line.split())


def plan(line: str) -> tuple[str, str]:
    """(what to do, why) for one README line; an AssertionError for a line neither table covers."""
    for key, instead in INSTEAD.items():
        if line == key or (key == "curl" and line.startswith("curl ")):
            return instead
    assert line.startswith("deriv "), f"README command neither run nor listed in test_tour.INSTEAD: {line!r}"
    return "run", "as written, with SMALL's settings"


def small(line: str) -> list[str]:
    return next((flags for prefix, flags in SMALL if line.startswith(prefix)), [])


def test_every_readme_command_is_run_or_listed():
    """Reading the README alone: each line has a plan, and each entry of the tables is still a README line (a
    stale entry would hide that the line it stood for went away)."""
    lines = readme_commands(README.read_text(encoding="utf-8"))
    assert len(lines) >= 20, lines
    for line in lines:
        plan(line)
    for key in INSTEAD:
        assert any(line == key or line.startswith(key + " ") for line in lines), f"INSTEAD lists {key!r}"
    for prefix, _ in SMALL:
        assert any(line.startswith(prefix) for line in lines), f"SMALL lists {prefix!r}"


def test_the_tables_catch_a_new_command():
    with pytest.raises(AssertionError, match="neither run nor listed"):
        plan("wget https://example.com/corpus.txt")
    assert strip_comment('curl -d \'{"a": "#1"}\'  # a comment') == 'curl -d \'{"a": "#1"}\''


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


def tiny_gpt2(folder: Path, tokenizer) -> str:
    """A GPT-2 checkpoint of 64 positions with the tests' tokenizer, as `gpt2` would be on the Hub."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=64)
    config.update({name: getattr(tokenizer, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")})
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def tiny_marian(folder: Path, tokenizer) -> str:
    """A Marian (OPUS-MT) checkpoint as tests/test_convert.py builds one, as the Hub's would be."""
    from test_convert import save_marian

    return str(save_marian(folder, tokenizer))


def run_deriv(argv: list[str], monkeypatch, capsys) -> None:
    from deriv_lm.cli import main

    if argv[0] == "chat":
        monkeypatch.setattr(sys, "stdin", io.StringIO(CHAT_INPUT))
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, f"deriv {shlex.join(argv)} exited {code}:\n{captured.err[-3000:]}"


def run_console_script(argv: list[str], cwd: Path) -> None:
    script = Path(sys.executable).parent / "deriv"
    done = subprocess.run([str(script), *argv], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"deriv {shlex.join(argv)} exited {done.returncode}:\n{done.stderr[-3000:]}"
    assert done.stdout.strip()


def curl(line: str, server) -> None:
    """The curl line's request (its URL's path and its -d body) to the server started by the serve line."""
    words = shlex.split(line)
    path = re.sub(r"^https?://[^/]+", "", next(w for w in words if w.startswith("http")))
    body = json.loads(words[words.index("-d") + 1])
    if body.get("stream"):
        events = server.stream(path, body)
        assert events and events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        assert server.post(path, body)["choices"][0]["message"]["content"] is not None


def explore(folder: str, tmp_path: Path) -> None:
    """`deriv explore FOLDER` in a child process: the page is served and the folder's model analyzes a text."""
    import json

    from deriv_lm.serving.client import ServerProcess

    server = ServerProcess(folder, command="explore", log=tmp_path / "explore.log")
    try:
        status, _, headers = server.send("GET", "/")
        assert status == 200 and headers["content-type"].startswith("text/html")
        status, reply, _ = server.send("POST", "/api/analyze", json.dumps({"text": "Return the"}).encode())
        assert status == 200 and reply["tokens"] and reply["next"]["candidates"], reply
    finally:
        assert server.stop() == 0, server.log_tail()


def missing_extra(line: str) -> str | None:
    import importlib.util

    module = next((m for prefix, m in EXTRAS.items() if line.startswith(prefix)), None)
    return module if module and importlib.util.find_spec(module) is None else None


def test_the_readme_tour_runs_as_written(tmp_path, monkeypatch, capsys, offline, tiny_tokenizer):
    """Every README command, in order, in one folder; the lines in INSTEAD as that table says."""
    from deriv_lm.serving.client import ServerProcess

    monkeypatch.chdir(tmp_path)
    server, done, skipped = None, [], []
    try:
        for line in readme_commands(README.read_text(encoding="utf-8")):
            what, why = plan(line)
            if what == "skip" or missing_extra(line):
                skipped.append((line, why if what == "skip" else f"needs {missing_extra(line)}"))
                continue
            words = shlex.split(line)
            if what == "shell":
                shell = line.replace("python ", f"{shlex.quote(sys.executable)} ", 1)
                subprocess.run(shell, shell=True, check=True, cwd=tmp_path, timeout=120)
            elif what == "activate":
                reason = check_activation(line)
                if reason:
                    skipped.append((line, reason))
                    continue
            elif what == "serve":
                server = ServerProcess(words[2], *words[3:], log=tmp_path / "serve.log")
            elif what == "explore":
                explore(words[2], tmp_path)
            elif what == "curl":
                assert server is not None, "the curl line comes before a deriv serve line"
                curl(line, server)
            elif what in ("gpt2", "marian"):
                source = (tiny_gpt2 if what == "gpt2" else tiny_marian)(tmp_path / f"hub-{what}", tiny_tokenizer)
                run_deriv(["import", source, *words[3:]], monkeypatch, capsys)
            elif line.startswith(CONSOLE_SCRIPT_LINE):
                run_console_script([*words[1:], *small(line)], tmp_path)
            else:
                run_deriv([*words[1:], *small(line)], monkeypatch, capsys)
            done.append(line)
    finally:
        if server is not None:
            server.stop()
    print("ran:", *done, "skipped:", *(f"{line}  ({why})" for line, why in skipped), sep="\n  ")
    assert any(line.startswith("deriv train lm") for line in done) and len(done) >= 15
