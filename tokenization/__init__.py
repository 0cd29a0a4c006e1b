"""Tokenization: corpora, byte-level BPE training with `tokenizers`, the reference trainer, the token viewer.

    from deriv_lm.tokenization import default_corpus, train_bpe, save_tokenizer
    tokenizer, summary = train_bpe(default_corpus(), vocab_size=8192)
    save_tokenizer(tokenizer, "my-tokenizer")          # AutoTokenizer.from_pretrained("my-tokenizer")

Knows nothing of models or training.
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
from .corpus import Corpus, add_corpus_arguments, corpus_from_args, default_corpus, hub_corpus, local_corpus


__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "Corpus",
    "add_corpus_arguments",
    "characters_per_token",
    "chat_template_with_generation_marks",
    "corpus_from_args",
    "default_corpus",
    "hub_corpus",
    "local_corpus",
    "save_tokenizer",
    "special_tokens_with",
    "to_transformers",
    "train_bpe",
]
