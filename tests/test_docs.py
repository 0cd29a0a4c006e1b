"""The derivation guide: its Python snippets run as written, in order, and its pictures are there."""

import re
from pathlib import Path


GUIDE = Path(__file__).parents[1] / "docs" / "derivation.md"


def test_guide_snippets_run(tmp_path, monkeypatch):
    text = GUIDE.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 8
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for number, block in enumerate(blocks, 1):
        exec(compile(block, f"docs/derivation.md, snippet {number}", "exec"), namespace)
    assert namespace["maps"].weights.shape[:2] == (2, 4)


def test_guide_pictures_exist_and_the_readme_links_the_guide():
    text = GUIDE.read_text()
    images = re.findall(r"!\[[^\]]*\]\((images/[^)]+)\)", text)
    assert len(images) >= 7
    for image in images:
        with open(GUIDE.parent / image, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", image
    for link in re.findall(r"\]\((\.\./[^)]+)\)", text):
        assert (GUIDE.parent / link).resolve().exists(), link
    assert "docs/derivation.md" in (GUIDE.parents[1] / "README.md").read_text()
