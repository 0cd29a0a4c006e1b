"""Deriv and the native architectures: `deriv import` (GPT-2 into Deriv) and `deriv export` (back).

The weights move; the network does not change: an imported model gives the source's logits (tests/test_convert.py).
"""

from .export import export_model
from .folders import import_model


__all__ = ["import_model", "export_model"]
