"""Data: where text comes from and how it becomes batches. Knows nothing of models.

corpus.py          documents: the embedded default corpus, local files, a `datasets` dataset (or a stream of one)
parallel.py        translation pairs: the machine's gettext catalogs, local .tsv / .jsonl, a `datasets` dataset
conversations.py   chat conversations: the embedded synthetic ones, local .jsonl, a `datasets` dataset
packing.py         the document split, tokenization with `datasets.map`, packing into blocks, the pairs'
                   encoding and the length-grouped sampler
streaming.py       the same for a stream that is never written to disk

from deriv_lm.data import default_corpus
for document in default_corpus(): ...
"""

from .corpus import Corpus, add_corpus_arguments, corpus_from_args, default_corpus, hub_corpus, local_corpus


__all__ = ["Corpus", "add_corpus_arguments", "corpus_from_args", "default_corpus", "hub_corpus", "local_corpus"]
