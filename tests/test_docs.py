"""The pages in docs/: their Python blocks run as written, in order, offline; their pictures and links are there.

Each page's ```python blocks run in one namespace, in a scratch folder, the way a reader would paste them into one
session. Blocks that need no trained model build their own; the others load the two tiny trained folders in
tests/data (see make_numbers_folder.py), which the pages find from the installed package. ```bash blocks and bare
``` blocks are shown, not run; a page may not hide Python in a ```py block, which would not run.
"""

import re
import socket
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs"
GUIDE = DOCS / "derivation.md"
PAGES = sorted(DOCS.glob("*.md"))
# The least number of Python blocks each page holds: a page that lost its examples fails here, not silently.
BLOCKS = {
    "derivation.md": 8,
    "training.md": 3,
    "translation.md": 5,
    "hub.md": 4,
    "model.md": 4,
    "tokenizer.md": 3,
    "convert.md": 1,
    "serving.md": 1,
    "chat.md": 1,
}


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)


@pytest.fixture
def offline(monkeypatch):
    """No block may reach the network: huggingface_hub and transformers stay offline, and a socket that tries to
    connect anywhere but a local file socket raises."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    connect = socket.socket.connect

    def refuse(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise OSError(f"a docs block tried to reach the network: {address}")
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.fixture
def one_thread(monkeypatch):
    """The blocks' models are tiny: one thread computes them as fast as two, and on a shared machine two threads
    wait on each other (ten times slower under load). The subprocess `deriv check` starts inherits the setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(threads)


def run_page(page: Path, tmp_path: Path, monkeypatch) -> dict:
    blocks = python_blocks(page)
    assert len(blocks) >= BLOCKS[page.name], f"{page.name} has {len(blocks)} Python blocks"
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for number, block in enumerate(blocks, 1):
        exec(compile(block, f"docs/{page.name}, block {number}", "exec"), namespace)
    return namespace


def test_guide_snippets_run(tmp_path, monkeypatch, offline, one_thread):
    namespace = run_page(GUIDE, tmp_path, monkeypatch)
    assert namespace["maps"].weights.shape[:2] == (2, 4)


# Pages whose blocks start a process: their test is in the slow tier (and, loading remote code, `upstream`).
SLOW_PAGES = {"hub.md": "`deriv check` loads the folder in a fresh interpreter, with trust_remote_code"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(page.name, marks=[pytest.mark.slow, pytest.mark.upstream] if page.name in SLOW_PAGES else [])
        for page in PAGES
        if page != GUIDE and python_blocks(page)
    ],
)
def test_page_blocks_run(name, tmp_path, monkeypatch, offline, one_thread):
    run_page(DOCS / name, tmp_path, monkeypatch)


def test_every_page_with_blocks_is_counted_and_no_python_hides_in_a_py_block():
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        assert "```py\n" not in text, f"{page.name}: a ```py block is not run; write ```python"
        if python_blocks(page):
            assert page.name in BLOCKS, f"{page.name} has Python blocks: add it to BLOCKS"
    for name in BLOCKS:
        assert (DOCS / name).exists(), name


def test_guide_pictures_exist():
    images = re.findall(r"!\[[^\]]*\]\((images/[^)]+)\)", GUIDE.read_text())
    assert len(images) >= 7
    for image in images:
        with open(GUIDE.parent / image, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", image


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#{1,6} (.+)$", page.read_text(encoding="utf-8"), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", [ROOT / "README.md"] + PAGES, ids=lambda page: page.name)
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", link):
            continue  # https:, mailto:
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        assert path.exists(), f"{page.name}: {link}"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{page.name}: {link} names no heading of {path.name}"


def test_the_readme_links_every_page_and_stays_a_front_door():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in PAGES:
        assert f"(docs/{page.name})" in readme, page.name
    assert len(readme.splitlines()) <= 200


def module_files() -> list[str]:
    """Every module file of the rooms, as `room/path.py` (`deriv_lm/serving/app.py`, `viz/explorer/app.py`). A room's
    `__init__.py` is its bold row in the table, not a line of its own."""
    import tomllib

    rooms = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]
    return sorted(
        path.relative_to(ROOT).as_posix()
        for folder in set(rooms.values())
        for path in (ROOT / folder).rglob("*.py")
        if path.name != "__init__.py" and "__pycache__" not in path.parts
    )


def model_md_files() -> set[str]:
    """The files docs/model.md's file table names, as `room/path` (a row's file under the last bold room row; a row
    that says "(the root)", as the path from the repository's root)."""
    named, room = set(), None
    for line in (DOCS / "model.md").read_text(encoding="utf-8").splitlines():
        cell = line.split("|")[1].strip() if line.startswith("| ") else ""
        header = re.fullmatch(r"\*\*`(.+?)/`\*\*", cell)
        if header:
            room = header.group(1)
        elif room:
            where = "" if "(the root)" in cell else f"{room}/"  # `deriv_lm_cli.py` (the root)
            named.update(f"{where}{name}" for name in re.findall(r"`([^`]+)`", cell))
    return named


def test_the_file_table_in_model_md_names_every_module_file_and_no_other():
    """docs/model.md is the map of the files: a module added without its line, or a line left for a module moved or
    deleted, fails here (DESIGN.md sends readers to it)."""
    files, named = module_files(), model_md_files()
    assert len(files) > 80, files  # the rooms were found
    assert [path for path in files if path not in named] == []
    gone = [name for name in named if name.endswith(".py") and not (ROOT / name).is_file()]
    assert gone == []
