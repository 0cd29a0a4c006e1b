"""Tokenization: byte-level BPE training with `tokenizers`, the reference trainer, the token viewer.

    from deriv_lm.data import default_corpus
    from deriv_lm.tokenization import train_bpe, save_tokenizer
    tokenizer, summary = train_bpe(default_corpus(), vocab_size=8192)
    save_tokenizer(tokenizer, "my-tokenizer")          # AutoTokenizer.from_pretrained("my-tokenizer")

Knows nothing of models, training or where text comes from (the data room, `deriv_lm.data`).
"""

from .bpe import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    characters_per_token,
    chat_template_with_generation_marks,
    save_tokenizer,
    special_tokens_with,
    to_transformers,
    train_bpe,
)


__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "characters_per_token",
    "chat_template_with_generation_marks",
    "save_tokenizer",
    "special_tokens_with",
    "to_transformers",
    "train_bpe",
]
