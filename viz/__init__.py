"""Seeing inside: attention maps and pictures of the derivation's parts, drawn from the real code.

Plotting needs matplotlib (`pip install 'deriv-lm[viz]'`); the weights themselves (`attention_maps`) do not.
"""

from .attention import AttentionMaps, attention_maps, load_eager, plot_attention, select
from .pictures import curves, plot_losses, positional_encoding, temperature, token_split


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
