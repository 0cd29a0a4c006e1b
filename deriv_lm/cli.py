"""The `deriv` command: a thin argument parser over the package's rooms.

The top-level parser is built from `COMMANDS` alone, without importing any room: each command is a stub that
takes the rest of the line as it is. Only the command given is then built for real (its room imported, its
arguments added by the function its entry names) and parses that rest. So this file imports nothing but the
standard library when it is loaded, and `deriv_lm_cli` (the console script) answers `deriv --help` from it
without importing the package. The rooms' command modules import torch and transformers only in the functions
that run a command, and paths are checked as the line is parsed (`deriv_lm.arguments.model_folder`), so bad
input is refused in a blink. The libraries' own progress bars and advisory warnings are off unless `--verbose`.

Bad input ends in one line, `deriv: error: ...`, naming the flag, file or folder and what is allowed,
and exit status 2; `deriv --debug ...` (or DERIV_DEBUG=1) shows the traceback instead. Any other exception is a
bug: its traceback, then `deriv: this is a bug in deriv; ...`, and exit status 1 (deriv_lm/errors.py says which
is which).

Ctrl-C (SIGINT) or SIGTERM ends any command with one line, `deriv: interrupted (SIGINT)`, and exit status 130;
every folder is written whole or not at all (`atomic_directory`), so nothing half-written is left. The
`deriv train` commands catch both signals themselves (training/stops.py): in the loop a checkpoint is saved
first; they end with their own line and the same 130.
"""

import argparse
import importlib
import os
import signal
import sys
import threading
import traceback
from contextlib import contextmanager
from typing import NamedTuple


DESCRIPTION = """\
Deriv: train, use, inspect and publish the transformer derived from first principles.
`deriv COMMAND --help` shows a command's arguments.

Bad input ends in one line, `deriv: error: ...`, naming the flag, file or folder and what is allowed,
and exit status 2; `deriv --debug ...` (or DERIV_DEBUG=1) shows the traceback instead.
Ctrl-C or SIGTERM ends any command with one line and exit status 130, leaving no half-written folder."""


class Command(NamedTuple):
    name: str
    help: str | None  # its line in `deriv --help`; None for an old spelling that still works but is not listed
    arguments: str  # "module:function" under deriv_lm: adds the command's arguments and its `func` to a parser
    # "module:function" under deriv_lm, given the rest of the line before the parser is built: for a command whose
    # parser is costly to build (train's HfArgumentParser imports transformers), the checks that need no parser
    precheck: str | None = None


COMMANDS = (
    Command(
        "train",
        "train a model (lm: the decoder language model; translation: the encoder-decoder; sft: chat fine-tuning)",
        "training.commands:add_arguments",
        "training.commands:check_line",
    ),
    Command("generate", "generate text from a trained model folder", "inference.commands:add_generate_arguments"),
    Command(
        "chat",
        "talk with a language-model folder in its chat template, replies streamed",
        "inference.commands:add_chat_arguments",
    ),
    Command(
        "translate", "translate text with a trained translation folder", "inference.commands:add_translate_arguments"
    ),
    Command(
        "eval",
        "score a model folder: perplexity (language model) or BLEU / chrF (translation)",
        "inference.commands:add_eval_arguments",
    ),
    Command(
        "card",
        "write the model card (README.md) of an exported folder from its records",
        "hub_card.commands:add_card_arguments",
    ),
    Command("push", "upload an exported folder to the Hugging Face Hub", "hub_card.commands:add_push_arguments"),
    Command(
        "serve",
        "serve a language-model folder over HTTP (OpenAI-compatible, streaming, continuous batching)",
        "serve:add_arguments",
    ),
    Command(
        "check",
        "load a folder as a Hub user would (no deriv_lm, offline) and report each step",
        "hub_card.commands:add_check_arguments",
    ),
    Command(
        "attention", "heat maps of a model's attention weights on a text (PNG)", "viz.commands:add_attention_arguments"
    ),
    Command(
        "picture",
        "pictures of the parts: positions, tokens, temperature, curves, kv-memory",
        "viz.commands:add_picture_arguments",
    ),
    Command(
        "explore",
        "a local web page on a model folder: tokens, embeddings, attention, the next token, generation step by step",
        "viz.commands:add_explore_arguments",
    ),
    Command("tokenizer", "train, show and measure byte-level BPE tokenizers", "tokenization.commands:add_arguments"),
    Command(
        "import",
        "import a GPT-2, Llama or Marian (OPUS-MT) checkpoint as a Deriv folder",
        "convert.commands:add_import_arguments",
    ),
    Command(
        "export",
        "export a Deriv folder as GPT-2, Llama or Marian, or for ONNX Runtime, CTranslate2 or llama.cpp (GGUF)",
        "convert.commands:add_export_arguments",
    ),
    Command("quantize", "write a folder with int8 linear weights (CPU)", "convert.commands:add_quantize_arguments"),
    Command(
        "bench",
        "benchmark Deriv against Hugging Face's peers at the same size: decoder, seq2seq, tokenizer, training, "
        "inference, serving, runtimes, ablation; `deriv bench gpu` runs the GPU check",
        "bench.commands:add_arguments",
    ),
    # the spellings before `deriv bench KIND`
    Command("bench-seq2seq", None, "bench.commands:add_seq2seq_arguments"),
    Command("bench-tokenizer", None, "bench.commands:add_tokenizer_arguments"),
    Command("bench-training", None, "bench.commands:add_training_arguments"),
)


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (the usage is one `--help` away) and the same prefix as ours."""

    def error(self, message: str):
        self.exit(2, f"deriv: error: {message} (see `{self.prog} --help`)\n")


class _Rest(Parser):
    """A command in the top-level parser: it keeps the rest of the line, untouched, for the command's own parser."""

    def parse_known_args(self, args=None, namespace=None):
        return argparse.Namespace(rest=list(args or [])), []


# What follows the traceback of an exception that is neither bad input (UsageError), the OS refusing a file
# (OSError) nor a missing extra: such an exception is a defect in deriv, never the user's doing.
BUG = "this is a bug in deriv; please report it with the traceback above"

# The exit status of a command stopped by SIGINT or SIGTERM: 128 + SIGINT, the shell's status for Ctrl-C. SIGTERM
# gives the same status (not 143): `deriv train` has always answered both with 130, and for a caller both mean
# "stopped on request, nothing half-written", not a crash.
INTERRUPTED = 130


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Python's default SIGINT raises KeyboardInterrupt: both unwind the same way, so every
    `finally` runs (a half-written folder is removed) instead of the process dying where it stands."""


def _raise_terminated(signum, frame):
    raise Terminated


def _sigterm_default_in_a_child() -> None:
    """subtle: a process forked while the handler is installed (a `datasets.map(num_proc=...)` worker) would
    inherit it, and its pool ends it with SIGTERM expecting it to die; a Python handler never runs while the
    worker waits in the pool's C semaphore (multiprocess as datasets 3 uses it), so `terminate()` waited for
    good. A child gets SIGTERM's default."""
    if signal.getsignal(signal.SIGTERM) is _raise_terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


os.register_at_fork(after_in_child=_sigterm_default_in_a_child)


@contextmanager
def _sigterm_as_interrupt():
    """SIGTERM unwinds like Ctrl-C for the duration (only the main thread may set a handler; elsewhere, as is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt_in(error: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt (or Terminated) `error` is or was raised while handling, if any. subtle: a signal that
    lands inside an import, or in a library's cleanup, can surface as another exception with the interrupt as its
    context: a ModuleNotFoundError as `deriv quantize` imported torchao was one. It is still Ctrl-C."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _swallowed_interrupt(unraisable) -> None:
    """sys.unraisablehook while a command runs. subtle: Python drops an exception raised in a `__del__` (or a weakref
    callback), printing "Exception ignored in ...": a Ctrl-C whose KeyboardInterrupt was raised there (`deriv eval`:
    "Exception ignored in Group.__del__") was lost and the command carried on to exit 0. The signal is raised again,
    a moment later, from another thread: raised here, in the main thread, it would be handled in this hook and lost
    again; from there it is handled at the next line the main thread runs once the finalizer is done (should it land
    in another finalizer, this hook sends it on once more). Anything else goes to Python's own hook."""
    stop = unraisable.exc_value
    if isinstance(stop, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
        signum = signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT
        try:
            threading.Thread(target=_interrupt_main_soon, args=(signum,), daemon=True).start()
            return
        except RuntimeError:  # the interpreter is shutting down: nothing is left to stop
            pass
    sys.__unraisablehook__(unraisable)


def _interrupt_main_soon(signum: int) -> None:
    import _thread
    import time

    time.sleep(0.05)
    _thread.interrupt_main(signum)


@contextmanager
def _interrupts_not_swallowed():
    previous, sys.unraisablehook = sys.unraisablehook, _swallowed_interrupt
    try:
        yield
    finally:
        sys.unraisablehook = previous


def main(argv: list[str] | None = None) -> int:
    top = build_parser().parse_args(argv)  # the standard library only: --help, a missing or unknown command
    debug = top.debug or os.environ.get("DERIV_DEBUG", "") not in ("", "0")
    if not (top.verbose or os.environ.get("DERIV_VERBOSE", "") not in ("", "0")):
        _quiet_libraries()
    try:
        with _sigterm_as_interrupt(), _interrupts_not_swallowed():
            return _run(top, debug)
    except BaseException as caught:
        stop = _interrupt_in(caught)
        if stop is None or debug:
            raise
        line = f"deriv: interrupted ({'SIGTERM' if isinstance(stop, Terminated) else 'SIGINT'})"
        if stop.args and isinstance(stop.args[0], str):  # what is true of the output, when a command says
            line += f"; {stop.args[0]}"
        del stop
    # subtle: here, outside the `except`, the traceback is gone and with it the frames it kept: a progress bar one
    # of them held open closes now (and prints its last line) before the one line, not after it
    import gc

    gc.collect()
    # on a new line: Ctrl-C often lands mid-line (a streamed reply, a progress bar, the terminal's ^C)
    print(f"\n{line}", file=sys.stderr)
    return INTERRUPTED


def _quiet_libraries() -> None:
    """Turn off what the libraries print that a user cannot act on: transformers' "Loading weights" bar on every
    load, and its info and advisory warnings (errors still show). Set before transformers is imported, which
    reads them then; a variable the user set wins. `deriv --verbose` (or DERIV_VERBOSE=1) keeps them all."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # subtle: transformers' bars follow huggingface_hub's switch, read once when transformers.utils.logging loads
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # datasets' bars ("Generating train split" as `deriv eval` reads a corpus); a training run turns its own maps'
    # bars (tokenizing, packing) back on where stderr is a terminal (training/driver.py)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


def _run(top: argparse.Namespace, debug: bool) -> int:
    """Build the command's parser (importing its room), parse the rest of the line, run it: bad input -> one line
    and status 2; any other exception is a bug -> its traceback, the line that says so, and status 1. Under
    `--debug` every exception propagates with its traceback."""
    refused = _precheck(top)
    if refused:
        return refused
    args = command_parser(top.command).parse_args(top.rest, argparse.Namespace(debug=top.debug, command=top.command))
    try:
        return args.func(args) or 0
    except SystemExit as stop:
        if not isinstance(stop.code, str):
            raise
        error = stop.code
    except Exception as caught:
        from .arguments import command_name
        from .errors import bad_input, missing_extra

        if debug or _interrupt_in(caught) is not None:
            raise
        error = bad_input(caught) or missing_extra(caught, command_name(args))
        if error is None:
            traceback.print_exc()
            print(f"deriv: {BUG}", file=sys.stderr)
            return 1
    from .errors import one_line

    print(f"deriv: error: {one_line(error)}", file=sys.stderr)
    return 2


def _precheck(top: argparse.Namespace) -> int:
    """Run the command's precheck on the raw line, if it has one: bad input -> one line and status 2, else 0."""
    command = next(c for c in COMMANDS if c.name == top.command)
    if command.precheck is None:
        return 0
    from .errors import bad_input, one_line

    module, function = command.precheck.split(":")
    try:
        getattr(importlib.import_module(f"deriv_lm.{module}"), function)(top.rest)
    except Exception as caught:
        error = bad_input(caught)
        debug = top.debug or os.environ.get("DERIV_DEBUG", "") not in ("", "0")
        if error is None or _interrupt_in(caught) is not None or debug:
            raise
        print(f"deriv: error: {one_line(error)}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> Parser:
    """The top-level parser: `--debug` and one stub per command. Imports no room."""
    parser = Parser(prog="deriv", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (also: DERIV_DEBUG=1)")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="keep the libraries' own progress bars and warnings, off by default (also: DERIV_VERBOSE=1)",
    )
    sub = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND", parser_class=_Rest)
    for command in COMMANDS:
        listed = {} if command.help is None else {"help": command.help}
        sub.add_parser(command.name, add_help=False, **listed)
    sub.choices = _Names(c.name for c in COMMANDS if c.help is not None)  # what "invalid choice" lists
    return parser


class _Names(list):
    """Command names as argparse checks a name: every command is in it, only the listed ones are shown."""

    def __contains__(self, name) -> bool:
        return any(c.name == name for c in COMMANDS)


def command_parser(name: str) -> Parser:
    """The full parser of one command (`deriv NAME ...`): imports the command's room, and only that."""
    command = next(c for c in COMMANDS if c.name == name)
    module, function = command.arguments.split(":")
    parser = Parser(prog=f"deriv {name}", description=command.help)
    getattr(importlib.import_module(f"deriv_lm.{module}"), function)(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The top-level parser answers `--help` and a missing or unknown command; the command's parser the rest."""
    top = build_parser().parse_args(argv)
    return command_parser(top.command).parse_args(top.rest, argparse.Namespace(debug=top.debug, command=top.command))


if __name__ == "__main__":
    sys.exit(main())
