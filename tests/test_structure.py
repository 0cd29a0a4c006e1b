"""The seams of the house (../DESIGN.md), checked on the source: who imports whom, and how long a function is."""

import ast
import pathlib

import pytest


ROOT = pathlib.Path(__file__).resolve().parent.parent
ROOMS = [
    "modeling_deriv",
    "tokenization",
    "data",
    "folder",
    "training",
    "inference",
    "hub_card",
    "viz",
    "bench",
    "convert",
    "deriv_lm",
]


def sources(*rooms: str):
    for room in rooms:
        for path in sorted((ROOT / room).rglob("*.py")):
            yield path, ast.parse(path.read_text(encoding="utf-8"))


def imported_modules(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            yield node.lineno, "." * node.level + (node.module or ""), [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []


def package_of(path: pathlib.Path) -> str:
    """The dotted package a source file's relative imports start from, as installed (`viz/explorer/app.py` is in
    `deriv_lm.viz.explorer`, `deriv_lm/serving/app.py` in `deriv_lm.serving`)."""
    parts = path.relative_to(ROOT).parent.parts
    return ".".join(parts if parts[0] == "deriv_lm" else ("deriv_lm", *parts))


def absolute_imports(path: pathlib.Path, tree: ast.AST):
    """(line, module) for each module a file imports, relative imports resolved; `from X import name` gives X and
    X.name both, since the name may be a module."""
    package = package_of(path).split(".")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, [base, node.module]))
            yield node.lineno, module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def is_command_module(module: str) -> bool:
    """A command module, the CLI's face of its room: a room's `commands.py`, or `deriv_lm/serve.py` (the `deriv serve`
    command, whose library is `serving/`)."""
    return module == "deriv_lm.serve" or (module.startswith("deriv_lm.") and module.endswith(".commands"))


def test_nothing_but_the_cli_imports_a_command_module():
    """Library code, and command modules too, import the rooms, never a command: what two commands share lives in a
    room (the servers' plumbing and client in `serving/`), so no command depends on another's flags or process."""
    offenders = []
    for path, tree in sources(*ROOMS):
        if path == ROOT / "deriv_lm" / "cli.py":
            continue
        for line, module in absolute_imports(path, tree):
            if is_command_module(module) and module != f"{package_of(path)}.{path.stem}":
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert offenders == []


def test_the_command_module_check_resolves_relative_imports():
    """The check above sees through every spelling of an import of a command module (a mutant of `absolute_imports`
    that misses one fails here)."""
    cases = {
        ("viz/explorer/measure.py", "from ...serve import ServerProcess"): "deriv_lm.serve",
        ("bench/serving.py", "from .. import serve"): "deriv_lm.serve",
        ("deriv_lm/serving/app.py", "from ..inference.commands import run"): "deriv_lm.inference.commands",
        ("viz/pictures.py", "from .commands import _done"): "deriv_lm.viz.commands",
        ("training/lm.py", "import deriv_lm.serve"): "deriv_lm.serve",
    }
    for (where, source), wanted in cases.items():
        found = {module for _, module in absolute_imports(ROOT / where, ast.parse(source))}
        assert wanted in found and is_command_module(wanted), (where, source, found)
    assert not is_command_module("deriv_lm.serving.server") and not is_command_module("deriv_lm.serving")


def test_rooms_import_each_other_relatively():
    """`from ..modeling_deriv import X`, as transformers' own files do, so the arrows between rooms show."""
    offenders = []
    for path, tree in sources(*ROOMS):
        for line, module, _ in imported_modules(tree):
            if module == "deriv_lm" or module.startswith("deriv_lm."):
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert offenders == []


def test_the_model_room_imports_no_other_room():
    """Its files are copied flat into every exported folder; they may import only each other."""
    for path, tree in sources("modeling_deriv"):
        for line, module, _ in imported_modules(tree):
            assert not module.startswith(".."), f"{path.name}:{line} imports {module}"


@pytest.mark.parametrize("path", sorted((ROOT / "training").glob("*.py")), ids=lambda p: p.name)
def test_no_function_in_the_training_room_is_longer_than_60_lines(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    long = [
        f"{node.name}: {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert long == []


def import_mirror(parent: pathlib.Path) -> pathlib.Path:
    """A tree in which `deriv_lm.training` is the folder deriv_lm/training, as installed: the source keeps its
    rooms at the top level (pyproject's package-dir), where import-linter's grimp cannot see them as
    subpackages. Symlinks only; every room pyproject maps is there."""
    import tomllib

    rooms = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]
    package = parent / "deriv_lm"
    package.mkdir()
    for entry in (ROOT / rooms.pop("deriv_lm")).iterdir():
        if entry.suffix == ".py" or (entry / "__init__.py").is_file():
            (package / entry.name).symlink_to(entry)
    for name, folder in rooms.items():
        (package / name.removeprefix("deriv_lm.")).symlink_to(ROOT / folder, target_is_directory=True)
    return parent


def test_the_import_contracts_hold(tmp_path):
    """pyproject's [tool.importlinter] contracts: the rooms' layers, the model room importing no other, nothing
    importing the CLI, nothing but the CLI importing a command module, training importing neither bench nor viz,
    and no cycle between siblings at any depth."""
    import os
    import shutil
    import subprocess
    import sys

    lint = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    if lint is None:
        pytest.skip("import-linter is not installed (the dev extra installs it): the contracts go unchecked")
    mirror = import_mirror(tmp_path)
    done = subprocess.run(
        [lint, "--no-cache", str(ROOT / "pyproject.toml")],
        cwd=mirror,
        env={**os.environ, "PYTHONPATH": str(mirror)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
