"""A look at the tokens: how a text splits, and what the vocabulary holds."""

from __future__ import annotations

import json
from collections import Counter

from .reference_bpe import unicode_to_bytes


def _token_bytes(token: str) -> bytes:
    """The bytes a byte-level token stands for ('Ġthe' -> b' the'); special tokens stand for their own text."""
    decode = unicode_to_bytes()
    if all(ch in decode for ch in token):
        return bytes(decode[ch] for ch in token)
    return token.encode("utf-8")


def show_tokens(tokenizer, text: str) -> str:
    """A table of the tokens of `text` (position, id, the text each token covers) and the characters per token."""
    encoding = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    lines = [f"{'#':>4}  {'id':>6}  token"]
    for position, (token_id, token) in enumerate(zip(encoding.ids, encoding.tokens, strict=True)):
        piece = _token_bytes(token).decode("utf-8", errors="backslashreplace")
        lines.append(f"{position:>4}  {token_id:>6}  {piece!r}")
    pieces = [_token_bytes(t).decode("utf-8", errors="replace") for t in encoding.tokens]
    lines.append("")
    lines.append("|".join(pieces))
    n = len(encoding.ids)
    ratio = f"{len(text) / n:.2f}" if n else "n/a"
    lines.append(f"{len(text)} characters, {n} tokens, {ratio} characters per token")
    return "\n".join(lines)


def vocabulary_stats(tokenizer) -> dict:
    """Size, special tokens, merges and token lengths of a trained tokenizer."""
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = backend["model"]["vocab"]
    special = {t["content"]: t["id"] for t in backend["added_tokens"] if t.get("special")}
    lengths = Counter(len(_token_bytes(token)) for token in vocab if token not in special)
    ordinary = [t for t in vocab if t not in special]
    longest = sorted(ordinary, key=lambda t: (-len(_token_bytes(t)), vocab[t]))[:10]
    return {
        "vocab_size": len(tokenizer),
        "special_tokens": special,
        "merges": len(backend["model"]["merges"]),
        "mean_token_bytes": sum(k * v for k, v in lengths.items()) / max(1, sum(lengths.values())),
        "tokens_by_byte_length": dict(sorted(lengths.items())),
        "longest_tokens": [_token_bytes(t).decode("utf-8", errors="backslashreplace") for t in longest],
        "model_max_length": tokenizer.model_max_length,
        "padding_side": tokenizer.padding_side,
    }


def format_stats(stats: dict) -> str:
    lines = [
        f"vocabulary: {stats['vocab_size']} ids ({stats['merges']} merges), model_max_length "
        f"{stats['model_max_length']}, padding on the {stats['padding_side']}",
        "special tokens: " + ", ".join(f"{t}={i}" for t, i in stats["special_tokens"].items()),
        f"mean token length: {stats['mean_token_bytes']:.2f} bytes",
        "tokens by byte length: " + ", ".join(f"{k}:{v}" for k, v in stats["tokens_by_byte_length"].items()),
        "longest tokens: " + ", ".join(repr(t) for t in stats["longest_tokens"]),
    ]
    if "characters_per_token" in stats:
        lines.append(f"characters per token on {stats['sample']}: {stats['characters_per_token']:.2f}")
    return "\n".join(lines)
