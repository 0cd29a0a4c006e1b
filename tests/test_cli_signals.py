"""Ctrl-C (SIGINT) and SIGTERM in any `deriv` command: one line on stderr, exit status 130, no traceback, and no
output folder, whole or in part.

The commands run as the console script runs them, each in its own process (the slow tier), and the signal is a
real one: sent from here once the command shows it is at work (the first streamed token), or sent by the process
to itself at a chosen moment (torch's ONNX exporter called; the weights written, the folder not yet in place), the
same moment on any machine however loaded. A few cheap checks run in this process (the fast tier).
"""

from __future__ import annotations

import importlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import make_model

from deriv_lm.cli import main


pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")

ROOT = Path(__file__).parents[1]
PROGRESS = re.compile(r"\[\d\d:\d\d[<,]")  # tqdm's "[00:00<?, ...]": a progress bar may stand before the line


# subtle: a shell without job control starts a background command (`make test &`, a CI runner) with SIGINT ignored,
# and a child inherits that: its Python then installs no KeyboardInterrupt handler and Ctrl-C does nothing. The
# commands here start as from a terminal, SIGINT raising KeyboardInterrupt, whoever started pytest.
AS_FROM_A_TERMINAL = "signal.signal(signal.SIGINT, signal.default_int_handler)"


def start(*argv: str, patch: str = "") -> subprocess.Popen:
    """`deriv ARGV` as the console script runs it (`deriv_lm_cli.main`) from a terminal, after `patch` (Python
    source), if any."""
    code = (
        f"import os, signal, sys\n{AS_FROM_A_TERMINAL}\n{patch}\nimport deriv_lm_cli\nsys.exit(deriv_lm_cli.main())\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(
        [sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def finish(process: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=timeout)
    finally:
        process.kill()  # a no-op once it has exited; a process that ignored the signal must not outlive the test
    return process.returncode, out, err


def assert_stopped(status: int, err: str, name: str = "SIGINT") -> None:
    """Exit 130, no traceback, and the stop is one line, `deriv: interrupted (NAME)`, the last on stderr.

    Lines that third-party imports print as the command starts (torchao's "Failed to load ..." where its
    compiled kernels do not match this torch) and progress bars may stand before it; no other line of ours."""
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and not PROGRESS.search(line)]
    assert status == 130, f"exit status {status}; stderr: {err[-3000:]}"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert lines[-1:] == [f"deriv: interrupted ({name})"], err[-3000:]
    assert [line for line in lines if line.startswith("deriv:")] == lines[-1:], err[-3000:]


def leftovers(out: Path) -> list[str]:
    """The folder itself, or the temporary folders a writer of it leaves beside it (`.NAME.partial-*`)."""
    return sorted(n for n in os.listdir(out.parent) if n == out.name or n.startswith(f".{out.name}."))


# ---- folders ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_lm(tmp_path_factory, tiny_tokenizer) -> Path:
    """A tiny language model with a context of 100,000 (sinusoidal positions cost nothing): a generation that runs
    for minutes unless it is stopped."""
    folder = tmp_path_factory.mktemp("signals") / "long"
    make_model(max_position_embeddings=100_000).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory, tiny_tokenizer) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    special = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # the tiny tokenizer's
    config = GPT2Config(vocab_size=len(tiny_tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=64, **special)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("signals") / "gpt2"
    GPT2LMHeadModel(config).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


# ---- in this process ----------------------------------------------------------------------------------------------


def interrupted_bench(monkeypatch, how):
    from deriv_lm.bench import training

    monkeypatch.setattr(training, "run", how)


def test_ctrl_c_is_one_line_and_130(monkeypatch, capsys):
    def ctrl_c(args):
        raise KeyboardInterrupt

    interrupted_bench(monkeypatch, ctrl_c)
    assert main(["bench", "training", "--steps", "1"]) == 130
    assert capsys.readouterr().err.strip() == "deriv: interrupted (SIGINT)"


def test_sigterm_unwinds_like_ctrl_c_and_its_handler_is_put_back(monkeypatch, capsys):
    ran_finally = []

    def terminated(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler raises at once; a default SIGTERM would have ended pytest itself
        finally:
            ran_finally.append(True)

    before = signal.getsignal(signal.SIGTERM)
    interrupted_bench(monkeypatch, terminated)
    assert main(["bench", "training", "--steps", "1"]) == 130
    assert capsys.readouterr().err.strip() == "deriv: interrupted (SIGTERM)"
    assert ran_finally == [True]  # every `finally` runs: how a half-written folder is removed
    assert signal.getsignal(signal.SIGTERM) is before


def test_debug_shows_the_traceback_of_an_interrupt(monkeypatch):
    def ctrl_c(args):
        raise KeyboardInterrupt

    interrupted_bench(monkeypatch, ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        main(["--debug", "bench", "training", "--steps", "1"])


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raising KeyboardInterrupt for the test, whoever started pytest (AS_FROM_A_TERMINAL)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_in_a_finalizer_still_stops_the_command(monkeypatch, capsys, ctrl_c_raises):
    """Python drops an exception raised in a `__del__`: a Ctrl-C that landed in one (`deriv eval`, "Exception
    ignored in Group.__del__") was lost, and eval carried on to exit 0."""
    from deriv_lm.inference import commands

    carried_on = []

    class Group:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)  # the KeyboardInterrupt is raised here, inside the finalizer

    def run_eval(args):
        Group()  # made and dropped: its __del__ runs at once
        for _ in range(100):
            time.sleep(0.01)
        carried_on.append(True)
        return 0

    monkeypatch.setattr(commands, "run_eval", run_eval)
    assert main(["eval", str(ROOT / "tests" / "data" / "numbers_lm")]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "deriv: interrupted (SIGINT)", err
    assert carried_on == []


@pytest.mark.parametrize("module", ["deriv_no_such_module", "torchao.quantization"])
def test_ctrl_c_inside_an_import_is_still_ctrl_c(module, monkeypatch, capsys):
    """A Ctrl-C that lands inside an import can surface as a ModuleNotFoundError whose context is the interrupt
    (`deriv quantize` importing torchao): one line and 130, not a bug's traceback, nor "needs the quantize extra"."""
    from deriv_lm.convert import commands

    for name in [n for n in sys.modules if n.startswith("torchao.")] + ["torchao"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if torchao's import had been cut short

    def run_quantize(args):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            importlib.import_module(module)

    monkeypatch.setattr(commands, "run_quantize", run_quantize)
    assert main(["quantize", str(ROOT / "tests" / "data" / "numbers_lm"), "--out", "unused"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "deriv: interrupted (SIGINT)", err


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(
        "".join(f"The transformer attends to token {i}. Attention is all you need.\n\n" for i in range(50))
    )
    return path


def tokenizer_train(corpus: Path, out: Path, *flags: str) -> int:
    return main(["tokenizer", "train", "--files", str(corpus), "--out", str(out), "--vocab-size", "300", *flags])


def test_ctrl_c_in_tokenizer_training_prints_nothing_after_its_line(monkeypatch, capsys, corpus, tmp_path):
    """A Ctrl-C while the corpus is read: the reading bar (held open by a frame of the traceback) printed its last
    line after `deriv: interrupted`."""
    from deriv_lm.tokenization import bpe

    real = bpe.byte_level_tokenizer

    class Interrupted:
        def __init__(self, model):
            self.tokenizer = real(model)

        def train_from_iterator(self, texts, trainer):
            next(texts), next(texts)  # reading the corpus, its bar open
            raise KeyboardInterrupt

    monkeypatch.setattr(bpe, "byte_level_tokenizer", Interrupted)
    assert tokenizer_train(corpus, tmp_path / "tok") == 130
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert lines[-1] == "deriv: interrupted (SIGINT)", err
    assert not (tmp_path / "tok").exists()


def test_ctrl_c_before_the_tokenizer_is_written_leaves_no_folder(monkeypatch, capsys, corpus, tmp_path):
    """Characters per token were measured after the folder was written: a Ctrl-C there said "interrupted" of a
    tokenizer written whole. They are measured first now, and a Ctrl-C there leaves no folder."""
    from deriv_lm.tokenization import commands

    def ctrl_c(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "characters_per_token", ctrl_c)
    assert tokenizer_train(corpus, tmp_path / "tok", "--no-progress") == 130
    assert capsys.readouterr().err.strip() == "deriv: interrupted (SIGINT)"
    assert not (tmp_path / "tok").exists()


def test_ctrl_c_once_the_tokenizer_is_in_place_says_it_was_written(monkeypatch, capsys, corpus, tmp_path):
    """The folder swapped in, the Ctrl-C after: the line says what is true, that the tokenizer was written whole."""
    from deriv_lm.tokenization import commands

    real = commands.save_tokenizer

    def save_then_ctrl_c(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "save_tokenizer", save_then_ctrl_c)
    out = tmp_path / "tok"
    assert tokenizer_train(corpus, out, "--no-progress") == 130
    captured = capsys.readouterr()
    assert captured.err.strip() == f"deriv: interrupted (SIGINT); the tokenizer was written whole to {out} first"
    assert captured.out == "" and (out / "tokenizer.json").is_file()


# ---- in a process of its own: the real signal -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_generating_ends_in_one_line(long_lm, signum):
    process = start("generate", str(long_lm), "the quick brown fox", "--max-new-tokens", "50000")
    try:
        first = process.stdout.read(1)  # the prompt and the first tokens stream out: it is generating
        assert first, f"it ended before generating: {process.communicate()[1][-3000:]}"
        process.send_signal(signum)
    finally:
        status, _, err = finish(process)
    assert_stopped(status, err, signal.Signals(signum).name)


# The process sends SIGINT to itself as torch's ONNX exporter is called, inside the temporary folder the export
# writes: the moment is the same on any machine (a signal sent after some wall time lands wherever the export is).
CTRL_C_IN_THE_ONNX_EXPORT = """
import torch.onnx
original = torch.onnx.export
def export(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    return original(*args, **kwargs)
torch.onnx.export = export
"""


@pytest.mark.slow
def test_ctrl_c_while_exporting_to_onnx_leaves_no_folder(gpt2_folder, tmp_path):
    pytest.importorskip("onnxscript", reason="the onnx extra is not installed (pip install 'deriv-lm[onnx]')")
    out = tmp_path / "onnx"
    process = start("export", str(gpt2_folder), "--to", "onnx", "--out", str(out), patch=CTRL_C_IN_THE_ONNX_EXPORT)
    status, _, err = finish(process)
    assert_stopped(status, err)
    assert leftovers(out) == []


# The process sends SIGINT to itself as soon as the weights are written into the temporary folder, before the
# folder is put in place: the moment at which a plain write would leave half a folder.
CTRL_C_AFTER_THE_WEIGHTS = """
import transformers
original = transformers.PreTrainedModel.save_pretrained
def save_pretrained(self, *args, **kwargs):
    original(self, *args, **kwargs)
    os.kill(os.getpid(), signal.SIGINT)
transformers.PreTrainedModel.save_pretrained = save_pretrained
"""


# The process sends SIGINT to itself as Python exits, after the command has printed its result: the moment a user's
# late Ctrl-C lands while torch's threads and modules are being freed.
CTRL_C_AS_IT_EXITS = """
import atexit, time
atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.5)))
"""


@pytest.mark.slow
def test_ctrl_c_after_the_last_line_exits_with_the_commands_status_and_no_stack(gpt2_folder, tmp_path):
    out = tmp_path / "imported"
    status, stdout, err = finish(start("import", str(gpt2_folder), "--out", str(out), patch=CTRL_C_AS_IT_EXITS))
    assert status == 0, f"exit status {status}; stderr: {err[-3000:]}"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert str(out) in stdout and (out / "model.safetensors").is_file()  # its result, said and written


@pytest.mark.slow
@pytest.mark.parametrize("command", ["import", "quantize"])
def test_ctrl_c_while_writing_a_folder_leaves_none(command, gpt2_folder, long_lm, tmp_path):
    if command == "quantize":
        pytest.importorskip("torchao", reason="deriv quantize needs the quantize extra")
    source = gpt2_folder if command == "import" else long_lm
    out = tmp_path / "out"
    status, _, err = finish(start(command, str(source), "--out", str(out), patch=CTRL_C_AFTER_THE_WEIGHTS))
    assert_stopped(status, err)
    assert leftovers(out) == []
