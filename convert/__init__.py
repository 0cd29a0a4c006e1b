"""Deriv and the native architectures: `deriv import` (GPT-2 into Deriv) and `deriv export` (back).

The weights move; the network does not change: an imported model gives the source's logits (tests/test_convert.py).
"""

import importlib


_WHERE = {
    "export_model": "export",
    "import_model": "folders",
}

__all__ = ["import_model", "export_model"]


def __getattr__(name: str):
    """The names above, each imported from its module when first asked for: `deriv COMMAND` imports this package
    to parse its arguments, which must not wait for torch (see deriv_lm/__init__.py)."""
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
