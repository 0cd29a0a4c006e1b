"""What a command's failure means, below the CLI: bad input (`UsageError`), a missing extra (`MissingExtra`),
and the one-line text both end in. Standard library only: `deriv_lm/cli.py` and every room import it.

    raise UsageError(f"--stride {stride} is longer than the model's window of {window} tokens")

The rule, for every room:

- Bad input (a flag out of range, a file or folder that is not what the command reads, a missing column)
  raises `UsageError`, whose text names the flag, file or folder and what is allowed; `MissingFile` for a file
  or folder the user named that is not there, `MissingKey` for a column, field, split or language the data
  lacks. They are a ValueError (and a FileNotFoundError, a KeyError), as Python's own functions answer a bad
  argument, so the Python API keeps its contract. The CLI prints one line, `deriv: error: ...`, status 2.
- A library that refuses input we passed on from the user (transformers on a malformed config.json, datasets
  on a file it cannot parse, huggingface_hub's strict config validation) is caught at our boundary, the loader
  or the corpus reader, and re-raised as a UsageError naming the folder, file or column, `from` the library's
  error.
- The OS refusing a file (`OSError`: permission denied, disk full, not found) is one line as well: bad input or
  a bad environment, never a defect in deriv.
- A plain ValueError stays for a violated internal contract: a bug. So does every other exception: the CLI
  shows its traceback, then `deriv: this is a bug in deriv; please report it with the traceback above`, and
  exits with status 1. `deriv --debug` (or DERIV_DEBUG=1) shows the traceback of a usage error too.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from contextlib import contextmanager


class UsageError(ValueError):
    """Bad input: the message names what was given and what is allowed. A ValueError, as Python's own
    functions answer a bad argument, so the Python API keeps its contract."""


class MissingFile(UsageError, FileNotFoundError):
    """A file or folder the user named does not exist (also a FileNotFoundError)."""


class MissingKey(UsageError, KeyError):
    """A column, field, split or language the user named is not in the data (also a KeyError, as a mapping
    answers a missing key, so the Python API keeps its contract)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""  # KeyError's own str() quotes the message


# What the OS says of a file or folder the user named (not found, permission denied, disk full): bad input or a
# bad environment, never a defect in deriv, so it is reported in one line as well.
ENVIRONMENT_ERRORS = (OSError,)


# The optional extras of pyproject.toml's [project.optional-dependencies] that a command may need, and the
# modules each brings. A command that needs one and does not find it ends in one line naming the pip line.
EXTRAS = {
    "viz": ("matplotlib",),  # attention, picture
    "onnx": ("onnx", "onnxscript", "onnxruntime"),  # export --to onnx (writing needs the first two, running all)
    "quantize": ("torchao",),  # quantize
    "lora": ("peft",),  # train sft --lora, and folders that hold a LoRA adapter
    "marian": ("sentencepiece",),  # import of an OPUS-MT checkpoint, and the folders that keep its tokenizer
    "serve": ("fastapi", "uvicorn", "pydantic", "openai"),  # serve, bench serving
    "trl": ("trl",),  # no command: the Python API's SFTTrainer
    "eval": ("lm_eval",),  # eval --tasks (lm-evaluation-harness)
    "runtimes": ("ctranslate2", "gguf"),  # export --to ctranslate2, export --to gguf
}
_EXTRA_OF_MODULE = {module: extra for extra, modules in EXTRAS.items() for module in modules}


class MissingExtra(ImportError):
    """A command needs an optional extra that is not installed (or does not import): one line, the pip line."""

    def __init__(self, command: str, extra: str, broken: str | None = None):
        why = f" ({broken})" if broken else ""
        super().__init__(f"{command} needs the {extra} extra{why}: pip install 'deriv-lm[{extra}]'")


def require_extra(extra: str, command: str, modules: tuple[str, ...] | None = None) -> None:
    """Import the modules of `extra` (or those of them that `command` uses), or raise MissingExtra.

    Called where a command starts, before it loads anything, so that a missing extra is found in a blink."""
    for module in modules or EXTRAS[extra]:
        try:
            importlib.import_module(module)
        except ImportError as error:
            missing = isinstance(error, ModuleNotFoundError) and _top(error.name) in EXTRAS[extra]
            broken = None if missing else f"{module} is installed but does not import: {one_line(error)}"
            raise MissingExtra(command, extra, broken) from error


def missing_extra(error: BaseException, command: str) -> MissingExtra | None:
    """The MissingExtra an ImportError amounts to: itself, or one raised from a module of an extra not being found
    (`import x` names it; transformers' checks say "X requires the SentencePiece library"). None for any other
    error, which is a bug and keeps its traceback."""
    while isinstance(error, ImportError):
        if isinstance(error, MissingExtra):
            return error
        name = error.name if isinstance(error, ModuleNotFoundError) else _required_library(str(error))
        if _top(name) in _EXTRA_OF_MODULE:
            return MissingExtra(command, _EXTRA_OF_MODULE[_top(name)])
        error = error.__cause__ or error.__context__
    return None


def _top(module: str | None) -> str:
    return (module or "").split(".")[0]


def _required_library(message: str) -> str | None:
    """The module a transformers backend check names: "... requires the SentencePiece library" -> sentencepiece."""
    found = re.search(r"requires the (\w+) library", message)
    return found and found.group(1).lower()


@contextmanager
def refused_as_usage(what: str) -> Iterator[None]:
    """A library's refusal of input we passed on from the user, as bad input: a ValueError (or huggingface_hub's
    strict-dataclass error, which wraps the config's own ValueError) raised inside becomes a UsageError naming
    `what` (the flags, file or folder the input came from), `from` the library's error.

        with refused_as_usage(f"--hidden {args.hidden} --heads {args.heads}"):
            config = DerivSeq2SeqConfig(hidden_size=args.hidden, encoder_attention_heads=args.heads, ...)
    """
    try:
        yield
    except UsageError:
        raise
    except Exception as error:
        strict = type(error).__name__.startswith("StrictDataclass")
        if not (strict or isinstance(error, ValueError)):
            raise
        cause = error.__cause__ if strict and error.__cause__ is not None else error
        raise UsageError(f"{what}: {one_line(cause)}") from error


def bad_input(error: Exception) -> Exception | None:
    """The error to report in one line if `error` is bad input (a UsageError, or the OS refusing a file); None if
    it is a bug (keep the traceback)."""
    if isinstance(error, (UsageError, *ENVIRONMENT_ERRORS)):
        return error
    return None


def one_line(error: BaseException | str) -> str:
    if isinstance(error, KeyError) and error.args:
        error = str(error.args[0])  # str(KeyError) adds quotes
    text = " ".join(str(error).split())
    return text or type(error).__name__
