"""The README's Python examples run as written, each alone (a reader may copy any one of them), in order, in a
scratch folder."""

import re
from pathlib import Path


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})  # a namespace of its own: no block leans on another
    assert (tmp_path / "tiny-deriv" / "model.safetensors").exists()
    assert (tmp_path / "tiny-deriv-mt" / "model.safetensors").exists()
