"""The sampling flags `deriv generate` and `deriv chat` share, and the `generate()` options they become.

One definition, so the two commands accept the same values, refuse the same mistakes and sample the same way.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from ..arguments import MAX_SEED, PENALTY_LIMIT, integer, number
from ..errors import UsageError


OPTIONS = ("max_new_tokens", "temperature", "top_k", "top_p", "num_beams", "repetition_penalty")
# subtle: `modeling_deriv.decode_loop.LOOPS`, which the parser cannot import without torch (`deriv generate --help`
# answers at once); tests/test_decode_loop_commands.py holds the two equal
DECODE_LOOPS = ("compiled", "eager")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """--max-new-tokens, --temperature, --top-k, --top-p, the penalties, --greedy and --seed; unset ones keep the
    folder's generation config."""
    parser.add_argument("--max-new-tokens", type=integer(minimum=1), default=None)
    parser.add_argument("--temperature", type=number(minimum=0), default=None, help="0 means greedy")
    parser.add_argument("--top-k", type=integer(minimum=0), default=None, help="0 keeps every token")
    parser.add_argument("--top-p", type=number(above=0, maximum=1), default=None)
    parser.add_argument("--repetition-penalty", type=number(above=0), default=None)
    penalty = number(minimum=-PENALTY_LIMIT, maximum=PENALTY_LIMIT)  # the OpenAI API's range, as deriv serve's
    parser.add_argument("--presence-penalty", type=penalty, default=0.0)
    parser.add_argument("--frequency-penalty", type=penalty, default=0.0)
    parser.add_argument("--greedy", action="store_true", help="no sampling: the most likely token each step")
    parser.add_argument("--seed", type=integer(minimum=0, maximum=MAX_SEED), default=0)
    add_decode_loop_argument(
        parser,
        "decode in Deriv's loop, the whole step compiled into one graph (greedy or sampling; see docs/model.md)",
    )


def add_decode_loop_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """--decode-loop, as `generate`, `chat` and `serve` take it: one of the loop's names, or unset for generate()'s
    own loop."""
    parser.add_argument("--decode-loop", choices=DECODE_LOOPS, default=None, help=help)


def sampling_options(ns: argparse.Namespace) -> dict:
    """The flags given, as `generate()` keyword arguments (`num_beams` too where the command has it)."""
    options = {k: getattr(ns, k) for k in OPTIONS if getattr(ns, k, None) is not None}
    if ns.greedy or options.get("temperature") == 0:
        options.pop("temperature", None)  # temperature 0 is the limit of sampling: the most likely token
        options["do_sample"] = False
    elif "temperature" in options:
        # subtle: a folder that decodes greedily (a chat fine-tune's) would keep do_sample=False and drop the
        # temperature with a warning; a temperature above 0 samples, as deriv serve reads a request's
        options["do_sample"] = True
    if getattr(ns, "decode_loop", None):
        check_decode_loop(ns, options)
        options["decode_loop"] = ns.decode_loop
    return options


def check_decode_loop(ns: argparse.Namespace, options: dict) -> None:
    """--decode-loop runs greedy search and sampling, with every flag here: refuse beams up front, by flag (the loop
    itself refuses what a folder's generation config asks for)."""
    if options.get("num_beams", 1) > 1:
        raise UsageError(f"--decode-loop decodes greedily or by sampling, not with --num-beams {options['num_beams']}")


def wanted_new_tokens(options: dict, model) -> int:
    """How many new tokens the user asked for: the flag, else the folder's generation config, else the context."""
    wanted = options.get("max_new_tokens", model.generation_config.max_new_tokens)
    return wanted or model.config.max_position_embeddings


def penalty_processors(ns: argparse.Namespace):
    """The presence and frequency penalties (OpenAI's), which `generate()` has no option for: the processors
    `decode_loop.penalty_processors` states once."""
    from ..modeling_deriv.decode_loop import penalty_processors

    return penalty_processors(ns.presence_penalty, ns.frequency_penalty)


@contextlib.contextmanager
def loop_refusals() -> Iterator[None]:
    """The decode loop's refusal of something a folder's generation config asks for (beams, a processor), as one line
    naming it instead of a traceback."""
    from ..modeling_deriv.decode_loop import DecodeLoopUnsupported

    try:
        yield
    except DecodeLoopUnsupported as error:
        raise UsageError(f"--decode-loop: {error}") from None
