"""A folder's chat template, rendered so that it reads no file, cannot hang and cannot crash what renders it.

A chat template is code the folder brings. transformers renders it in jinja's `ImmutableSandboxedEnvironment`,
which keeps it from Python's internals, but not from running as long as it likes (two nested loops of
`range(100000)` are 10^10 steps: `deriv chat` hangs, and a server's request holds a worker thread, and with it
the tokenizer and the server's shutdown, for hours), nor from naming another template (`{% include %}`,
`{% extends %}`, `{% import %}`, `{% from %}`), which fails deep inside jinja since the environment has no loader.

So every rendering of a folder's template in Deriv goes through `render_chat` (`deriv chat`, `deriv serve`'s
/v1/chat/completions, chat fine-tuning), which

- refuses a template that names another one, from its syntax tree, before anything renders
  (`check_template_source`; `deriv chat`, `deriv serve` and `train sft --init-from` call it when they open the
  folder): there is no loader, and none should read files;
- renders it with a budget: at most MAX_STEPS steps (each block a loop's iteration or an `{% if %}` enters, each
  call, each filter), MAX_SECONDS seconds and MAX_CHARACTERS characters written or held in one value; past any of
  them the rendering stops with `ChatTemplateError`;
- turns every failure the template causes (a syntax error, jinja's own refusals, `raise_exception`, a
  RecursionError from a macro that calls itself, a TypeError from adding a number to a string) into one
  `ChatTemplateError` line naming the folder: the command prints it, the server answers 400 naming `messages`.

`check_chat_template(tokenizer, where)` is both checks on a one-message probe, for the commands that open a folder
to chat with it.

subtle: the budget is counted in the rendering thread, by the compiled template itself, not by rendering in a
worker process under a timeout: a process per message would cost its start and transformers' imports, and a
server's thread cannot be killed. What a count cannot interrupt is a single builtin that runs long on its own (a
string centred in a billion, `9 ** 999999999`); those are refused before they are called, from their arguments.
Memory is bounded through the characters: a value of 16 Mi characters is at most 64 MB.
"""

from __future__ import annotations

import functools
import threading
import time
from contextvars import ContextVar

from ..errors import UsageError


MAX_STEPS = 1_000_000  # Deriv's template renders 35,000 messages (a 1.3 MB request body) in 210,000
MAX_SECONDS = 2.0
MAX_CHARACTERS = 1 << 24  # 16 Mi characters written in all, or in one string or list; far past any context
MAX_INTEGER_BITS = 1 << 16  # an integer a `*` or `**` may make (20,000 digits); a chat template counts messages
# the tags that name another template, and the words a template spells them with
FOREIGN_TAGS = {"Include": "include", "Extends": "extends", "Import": "import", "FromImport": "from ... import"}
PROBE = [{"role": "user", "content": "hello"}]


class ChatTemplateError(UsageError):
    """A chat template that cannot be rendered, on one line; `why` is the reason without the folder's name
    ("uses {% include %} ...", "takes more than ..."), for a server to put in its own words."""

    def __init__(self, where: str, why: str):
        super().__init__(f"{where}: its chat template {why}")
        self.why = why


class _OverBudget(Exception):
    """Raised inside the rendering when a budget runs out; `render_chat` makes it a ChatTemplateError."""


class _Budget:
    """What one rendering may still spend. subtle: it lives in a ContextVar, not on the environment, since one
    compiled template serves the server's worker threads at once, and each rendering has a budget of its own."""

    __slots__ = ("steps", "characters", "deadline")

    def __init__(self):
        self.steps = MAX_STEPS
        self.characters = MAX_CHARACTERS
        self.deadline = time.monotonic() + MAX_SECONDS

    def step(self) -> None:
        self.steps -= 1
        if self.steps < 0:
            raise _OverBudget(f"takes more than {MAX_STEPS:,} steps to render (loop iterations, calls and filters)")
        if time.monotonic() > self.deadline:
            raise _OverBudget(f"takes more than {MAX_SECONDS:g} s to render")

    def write(self, text):
        self.characters -= len(text)
        if self.characters < 0:
            raise _OverBudget(f"writes more than {MAX_CHARACTERS:,} characters")
        return text


_BUDGET: ContextVar[_Budget | None] = ContextVar("deriv_chat_template_budget", default=None)


def _step() -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.step()


def _sized(value):
    """`value`, unless it is a string or collection larger than a template may hold."""
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)) and len(value) > MAX_CHARACTERS:
        raise _OverBudget(f"makes a value of {len(value):,} characters or items (at most {MAX_CHARACTERS:,})")
    return value


def _check_arguments(values) -> None:
    """Refuse an integer argument so large that a call would build a huge string before it returns
    (`'x'.center(10**9)`, `'x'|indent(10**9)`): a width past MAX_CHARACTERS is past anything a template needs."""
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_CHARACTERS:
            raise _OverBudget(f"passes {value:,} to a filter or string method (at most {MAX_CHARACTERS:,})")


def _product_size(left, right) -> None:
    """Refuse `left * right` before it is computed when the result would be too large."""
    for count, other in ((left, right), (right, left)):
        if isinstance(count, int) and isinstance(other, (str, bytes, list, tuple)):
            if count * len(other) > MAX_CHARACTERS:
                raise _OverBudget(f"repeats a value of {len(other):,} items {count:,} times")
    if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INTEGER_BITS:
        raise _OverBudget(f"multiplies integers past {MAX_INTEGER_BITS:,} bits")


def _power_size(base, exponent) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if base.bit_length() * exponent > MAX_INTEGER_BITS:
            raise _OverBudget(f"raises an integer to the power {exponent:,}: past {MAX_INTEGER_BITS:,} bits")


def _bounded_filter(function):
    """A filter that counts a step, refuses a huge integer argument and a huge result. functools.wraps keeps
    jinja's `jinja_pass_arg` mark (it copies `__dict__`), so a filter that takes the context still gets it."""

    value_at = 2 if hasattr(function, "jinja_pass_arg") else 1  # after the context (if passed) and the value

    @functools.wraps(function)
    def bounded(*args, **kwargs):
        _step()
        _check_arguments((*args[value_at:], *kwargs.values()))
        return _sized(function(*args, **kwargs))

    return bounded


def _environment_class():
    """The sandbox transformers renders in, with a budget. Built when first needed: importing jinja2 is the
    caller's cost, not every importer's."""
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    STEP = "deriv step"  # not an identifier: no extension's attribute has this name

    class CountingCodeGenerator(CodeGenerator):
        """subtle: the budget is counted in the compiled template's own code, not in what it calls: a loop that
        calls nothing (`{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}` over a long string) makes no
        call a sandbox could count. jinja writes `pass` at the top of every block it compiles (a loop's body, an
        `if` branch, a macro's body); a step is counted there, so every iteration of every loop counts. What a
        template writes is counted where jinja writes it (`yield` or a buffer's append), so a loop that writes a
        long constant 10^6 times stops too."""

        def blockvisit(self, nodes, frame) -> None:
            self.writeline("environment.step()")
            super().blockvisit(nodes, frame)

        def visit_For(self, node, frame) -> None:
            """A filtered loop (`{% for x in xs if test %}`) tests every item, and runs no body for those it
            skips: the test counts a step too, as `environment.step() or test` (jinja allows no node types of
            one's own; an EnvironmentAttribute, which only an extension can make, is written as the call)."""
            if node.test is not None:
                step = nodes.EnvironmentAttribute(STEP, lineno=node.lineno)
                node.test = nodes.Or(step, node.test, lineno=node.lineno)
            super().visit_For(node, frame)

        def visit_EnvironmentAttribute(self, node, frame) -> None:
            if node.name == STEP:
                self.write("environment.step()")
            else:
                super().visit_EnvironmentAttribute(node, frame)

        def _output_child_pre(self, node, frame, finalize) -> None:
            self.write("environment.write(")
            super()._output_child_pre(node, frame, finalize)

        def _output_child_post(self, node, frame, finalize) -> None:
            super()._output_child_post(node, frame, finalize)
            self.write(")")

        def _output_const_repr(self, group) -> str:
            return f"environment.write({super()._output_const_repr(group)})"

        def visit_Concat(self, node, frame) -> None:  # `a ~ b`, which no binary operator hook sees
            self.write("environment.sized(")
            super().visit_Concat(node, frame)
            self.write(")")

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """`*` and `**` are checked before they compute (a string repeated 10^9 times, 9 ** 9 ** 9), `+` and `%`
        after; intercepted operators are also never folded at compile time, where 9 ** 9 ** 9 would hang the
        compiler itself."""

        code_generator_class = CountingCodeGenerator
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        @staticmethod
        def step() -> None:
            _step()

        @staticmethod
        def write(text):
            budget = _BUDGET.get()
            return text if budget is None else budget.write(text)

        sized = staticmethod(_sized)

        def call_binop(self, context, operator, left, right):
            _step()
            if operator == "*":
                _product_size(left, right)
            elif operator == "**":
                _power_size(left, right)
            return _sized(super().call_binop(context, operator, left, right))

        def call(self, context, obj, /, *args, **kwargs):
            _step()
            if isinstance(getattr(obj, "__self__", None), (str, bytes)):  # 'x'.center(n), .ljust, .zfill, ...
                _check_arguments((*args, *kwargs.values()))
            return _sized(super().call(context, obj, *args, **kwargs))

    return BoundedEnvironment


@functools.lru_cache(maxsize=1)
def _environment():
    """The bounded environment, with transformers' own options, filters, globals and extensions (its
    `{% generation %}` tag, loop controls, `raise_exception`, `tojson`, ...), taken from the environment it
    compiles an empty template in, so a template renders here as it does there."""
    from transformers.utils import chat_template_utils

    original = getattr(chat_template_utils._compile_jinja_template, "deriv_original", None)
    base = (original or chat_template_utils._compile_jinja_template)("").environment
    options = ("trim_blocks", "lstrip_blocks", "keep_trailing_newline", "autoescape", "undefined", "finalize")
    environment = _environment_class()(
        **{name: getattr(base, name) for name in options},
        extensions=[type(extension) for extension in base.extensions.values()],
    )
    environment.globals.update(base.globals)
    environment.filters.update({name: _bounded_filter(f) for name, f in base.filters.items()})
    return environment


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    return _environment().from_string(template)


_install_lock = threading.Lock()


def _install() -> None:
    """Route transformers' compilation of a chat template to the bounded environment while a budget is active
    (inside `render_chat`), and to its own otherwise: Deriv bounds its renderings, not a caller's.

    subtle: transformers has no hook for the environment; `apply_chat_template` renders through the module
    function `render_jinja_template`, which compiles with `chat_template_utils._compile_jinja_template` looked up
    at call time, so replacing that name reaches every rendering, and `sanitize_control_tokens`, the assistant
    mask and the tokenization stay transformers' own. tests/test_chat_template_hostile.py fails if a release of
    transformers renders some other way."""
    from transformers.utils import chat_template_utils

    with _install_lock:
        original = chat_template_utils._compile_jinja_template
        if getattr(original, "deriv_original", None) is not None:
            return

        def compile_template(template):
            return original(template) if _BUDGET.get() is None else _compiled(template)

        compile_template.deriv_original = original
        compile_template.cache_clear = original.cache_clear
        chat_template_utils._compile_jinja_template = compile_template


def _templates(template) -> list[str]:
    """A tokenizer's chat_template: one string, or (from some folders) a dict of named ones."""
    if isinstance(template, dict):
        return [t for t in template.values() if isinstance(t, str)]
    return [template] if isinstance(template, str) else []


@functools.lru_cache(maxsize=64)
def _source_problem(template: str) -> str | None:
    """Why `template` cannot be rendered, from its syntax tree and then its compilation (nothing of it runs),
    or None. The tree comes first: a template that names another is refused before it is compiled."""
    from jinja2 import TemplateSyntaxError, nodes

    kinds = tuple(getattr(nodes, name) for name in FOREIGN_TAGS)
    try:
        node = next(_environment().parse(template).find_all(kinds), None)
    except TemplateSyntaxError as error:
        return f"is not valid Jinja: {_one_line(error.message or error)} (line {error.lineno})"
    except RecursionError:  # the parser and the tree's walk recurse once per level of nesting
        return "is nested too deeply to be read"
    if node is not None:
        tag = FOREIGN_TAGS[type(node).__name__]
        return (
            f"uses {{% {tag} %}} (line {node.lineno}), which reads another template: a chat template must stand "
            "alone, and Deriv renders it with no loader, so it reads no file"
        )
    return _compile_problem(template)


def _compile_problem(template: str) -> str | None:
    """subtle: a template jinja parses may still not compile: `1 + 1 + ...` 500 times nests past Python's
    recursion limit in jinja's compiler, 100 nested `{% if %}` past the indentation Python's own compiler
    allows. Compiled here (and kept: `_compiled` caches it), each is one line instead of a traceback."""
    from jinja2 import TemplateSyntaxError

    try:
        _compiled(template)
    except TemplateSyntaxError as error:  # an unknown filter or test, ...
        return f"is not valid Jinja: {_one_line(error.message or error)} (line {error.lineno})"
    except (RecursionError, SyntaxError, MemoryError):
        return "is nested too deeply to be compiled"
    return None


def check_template_source(template, where: str) -> None:
    """Refuse, naming `where`, a chat template that is not valid Jinja or names another template
    (include, extends, import, from-import). Parsing only: nothing of the template runs."""
    for source in _templates(template):
        why = _source_problem(source)
        if why:
            raise ChatTemplateError(where, why)


def render_chat(tokenizer, conversation, where: str = "the tokenizer", **kwargs):
    """`tokenizer.apply_chat_template(conversation, **kwargs)` within the budget of the module docstring; a
    template that fails, or would not end, is one ChatTemplateError naming `where` (the folder)."""
    from jinja2 import TemplateError

    check_template_source(kwargs.get("chat_template") or tokenizer.chat_template, where)
    _install()
    token = _BUDGET.set(_Budget())
    try:
        return tokenizer.apply_chat_template(conversation, **kwargs)
    except _OverBudget as error:
        raise ChatTemplateError(where, str(error)) from None
    except TemplateError as error:
        if type(error) is TemplateError:  # the template's own raise_exception, e.g. roles out of order
            raise ChatTemplateError(where, f"refuses the conversation: {_one_line(error)}") from None
        raise ChatTemplateError(where, f"fails in jinja's sandbox: {_one_line(error)}") from None
    except Exception as error:
        if not _raised_by_template(error):
            raise
        raise ChatTemplateError(where, f"fails: {type(error).__name__}: {_one_line(error)}") from None
    finally:
        _BUDGET.reset(token)


def check_chat_template(tokenizer, where: str) -> None:
    """The template's source (`check_template_source`), then a one-message conversation rendered within the
    budget, as every use renders it: a template that fails there is one ChatTemplateError naming `where` (the
    folder), before any conversation is read."""
    check_template_source(tokenizer.chat_template, where)
    render_chat(tokenizer, PROBE, where, add_generation_prompt=True, tokenize=False)


def _raised_by_template(error: BaseException) -> bool:
    """Whether the template's own compiled code is on the error's traceback (jinja names those frames after the
    template, `<template>` for one made from a string): a RecursionError from a macro calling itself, a
    TypeError from `1 + 'a'`; an error from anywhere else is a bug, and stays one."""
    traceback = error.__traceback__
    while traceback is not None:
        if traceback.tb_frame.f_code.co_filename == "<template>":
            return True
        traceback = traceback.tb_next
    return False


def _one_line(error) -> str:
    return " ".join(str(error).split()) or type(error).__name__
