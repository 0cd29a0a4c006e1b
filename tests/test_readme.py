"""The README's Python examples run as written (in order, in one namespace, in a scratch folder)."""

import re
from pathlib import Path


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    assert (tmp_path / "tiny-deriv" / "model.safetensors").exists()
    assert (tmp_path / "tiny-deriv-mt" / "model.safetensors").exists()
