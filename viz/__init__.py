"""Seeing inside: attention maps and pictures of the derivation's parts, drawn from the real code.

Plotting needs matplotlib (`pip install 'deriv-lm[viz]'`); the weights themselves (`attention_maps`) do not.
"""

import importlib


_WHERE = {
    "AttentionMaps": "attention",
    "attention_maps": "attention",
    "load_eager": "attention",
    "plot_attention": "attention",
    "select": "attention",
    "curves": "pictures",
    "plot_losses": "pictures",
    "positional_encoding": "pictures",
    "temperature": "pictures",
    "token_split": "pictures",
}

__all__ = [
    "AttentionMaps",
    "attention_maps",
    "load_eager",
    "plot_attention",
    "select",
    "positional_encoding",
    "token_split",
    "temperature",
    "curves",
    "plot_losses",
]


def __getattr__(name: str):
    """The names above, each imported from its module when first asked for: `deriv COMMAND` imports this package
    to parse its arguments, which must not wait for torch (see deriv_lm/__init__.py)."""
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
