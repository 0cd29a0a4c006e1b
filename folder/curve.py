"""loss.png, the curve every exported folder carries (training and validation loss against tokens seen), and
the two matplotlib helpers every picture uses: a file backend, and a file written whole or not at all.

The folder room draws it because the curve is part of the folder's layout (DESIGN.md); `deriv picture curves`
(the viz room) draws it again from a folder's metrics.jsonl.
"""

from __future__ import annotations

import os


def pyplot():
    """matplotlib.pyplot with a file backend, or an error that says how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "Pictures need matplotlib: pip install matplotlib, or pip install 'deriv-lm[viz]'"
        ) from error
    return plt


def save(fig, path: str) -> str:
    """Write `fig` as `path` whole or not at all: under a temporary name beside it, then renamed, so that Ctrl-C
    midway leaves no truncated picture. The format is the extension's (PNG without one); returns `path`."""
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.partial-{os.getpid()}")
    try:
        fig.savefig(tmp, format=os.path.splitext(name)[1][1:].lower() or "png")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def plot_losses(history: list[dict], path: str) -> bool:
    """Training and validation loss against tokens seen, as a PNG; False when matplotlib is missing.

    `history` is the trainer's log, one dict per line of `metrics.jsonl` (`tokens_seen`, and `train_loss` or
    `val_loss`); the trainer draws `loss.png` with it, and `curves` draws it again from a folder."""
    try:
        plt = pyplot()
    except ImportError:
        return False
    train = [(r["tokens_seen"], r["train_loss"]) for r in history if "train_loss" in r]
    val = [(r["tokens_seen"], r["val_loss"]) for r in history if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(*zip(*train, strict=True), label="training loss", linewidth=1)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save(fig, path)
    plt.close(fig)
    return True
