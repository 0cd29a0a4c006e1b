"""Byte-pair encoding by hand: the algorithm the `tokenizers` BpeTrainer runs, in plain Python.

BPE (Sennrich et al. 2016, byte-level as in GPT-2) starts from single bytes and repeatedly merges
the most frequent adjacent pair of symbols into a new symbol, until the vocabulary is full:

    words   = pre-tokenized text, each word a list of symbols       "hug" -> [h, u, g]
    repeat:   (a, b) = the most frequent adjacent pair over all words
              replace every a b by the new symbol ab; vocab += [ab]; merges += [(a, b)]

Two ideas make it fast enough to be usable in plain Python:
- Count per *distinct* word, weighted by how often it occurs: [("hug", 10), ("pug", 5)] ->
  {(h, u): 10, (u, g): 15, (p, u): 5}. Text has far fewer distinct words than words.
- Keep pair counts in a max-heap with lazy invalidation, and after each merge touch only the
  words that contain the merged pair; a popped entry whose count is stale is pushed back with
  the current count instead of being searched for and updated in place.

To produce the library's merges exactly, this follows its choices (tokenizers/src/models/bpe/trainer.rs):
- ids: special tokens first, then the alphabet (every character of the corpus and the 256 byte
  symbols) in code-point order, then merged symbols in the order they are made;
- a count tie goes to the pair with the smaller (id_a, id_b);
- a heap entry remembers the words it was pushed for, and a merge rewrites exactly those words;
- subtle: a merge that spells an existing symbol (ab + c and a + bc both give abc) reuses its
  id and adds nothing to the vocabulary; if a pair is merged twice, the later rank is kept.
Training stops when the vocabulary reaches `vocab_size` or no pair occurs any more.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Iterable
from functools import lru_cache

import regex


# GPT-2's split: contractions, letters, digits, other symbols, each with one optional leading space;
# runs of whitespace stay whole except for the space in front of the next word (tokenizers' ByteLevel).
GPT2_SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

Pair = tuple[int, int]


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters.

    Printable Latin-1 bytes map to themselves; the others (control bytes, space, ...) are
    shifted to 256 + n, so every byte is one visible character: 32 (space) -> 'Ġ', 10 -> 'Ċ'.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(shifted)}}


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    """The inverse of `bytes_to_unicode`: 'Ġ' -> 32."""
    return {ch: b for b, ch in bytes_to_unicode().items()}


def spell(piece: str) -> str:
    """A piece of text in byte symbols: ' world' -> 'Ġworld'."""
    table = bytes_to_unicode()
    return "".join(table[b] for b in piece.encode("utf-8"))


def pretokenize(text: str) -> list[str]:
    """Split text the way the ByteLevel pre-tokenizer does, each piece spelled in byte symbols.

    >>> pretokenize("Hello world!")
    ['Hello', 'Ġworld', '!']
    """
    return [spell(piece) for piece in GPT2_SPLIT.findall(text)]


def word_counts(texts: Iterable[str]) -> Counter[str]:
    """How often each distinct pre-tokenized word occurs: the only statistics BPE needs."""
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(GPT2_SPLIT.findall(text))
    # Spell each distinct piece in byte symbols once, not once per occurrence.
    spelled: Counter[str] = Counter()
    for piece, n in counts.items():
        spelled[spell(piece)] += n
    return spelled


def initial_vocab(counts: dict[str, int], special_tokens: list[str]) -> list[str]:
    """Special tokens, then every symbol of the corpus and of the byte alphabet, in code-point order."""
    alphabet = set(bytes_to_unicode().values())
    for word in counts:
        alphabet.update(word)
    return [*special_tokens, *sorted(alphabet - set(special_tokens))]


def _merge_word(word: list[int], pair: Pair, new_id: int) -> list[tuple[Pair, int]]:
    """Replace each a b in `word` (left to right, not overlapping) by `new_id`, in place.

    Returns the changes to neighbouring pairs, as the library counts them:
    [x a b y] -> [x ab y] gives ((x, a), -1), ((x, ab), +1), ((b, y), -1), ((ab, y), +1).
    """
    a, b = pair
    changes = []
    i = 0
    while i < len(word) - 1:
        if word[i] == a and word[i + 1] == b:
            if i > 0:
                changes += [((word[i - 1], a), -1), ((word[i - 1], new_id), 1)]
            word[i : i + 2] = [new_id]
            if i < len(word) - 1:
                changes += [((b, word[i + 1]), -1), ((new_id, word[i + 1]), 1)]
        i += 1
    return changes


def train(counts: dict[str, int], vocab_size: int, special_tokens: list[str]) -> tuple[dict[str, int], list[Pair]]:
    """Learn a vocabulary of `vocab_size` symbols from word counts; returns (vocab, merges as symbol pairs)."""
    id_to_token = initial_vocab(counts, special_tokens)
    token_to_id = {token: i for i, token in enumerate(id_to_token)}
    words = [[token_to_id[ch] for ch in word] for word in counts]
    weight = list(counts.values())

    # Pair counts over all words, and for each pair the words it occurs in.
    pair_counts: Counter[Pair] = Counter()
    where: defaultdict[Pair, set[int]] = defaultdict(set)
    for w, word in enumerate(words):
        for pair in zip(word, word[1:], strict=False):
            pair_counts[pair] += weight[w]
            where[pair].add(w)

    # Max-heap of (count, pair) as a min-heap of (-count, pair); the counter keeps equal entries in push order.
    heap: list[tuple[int, Pair, int, set[int]]] = []
    pushes = 0

    def push(pair: Pair, count: int, positions: set[int]) -> None:
        nonlocal pushes
        heapq.heappush(heap, (-count, pair, pushes, positions))
        pushes += 1

    for pair, positions in where.items():
        push(pair, pair_counts[pair], positions)

    merges: list[tuple[Pair, int]] = []
    while len(token_to_id) < vocab_size and heap:
        negative_count, pair, _, positions = heapq.heappop(heap)
        if -negative_count != pair_counts[pair]:  # stale: the pair lost occurrences since it was pushed
            push(pair, pair_counts[pair], positions)
            continue
        if pair_counts[pair] < 1:
            break
        new_token = id_to_token[pair[0]] + id_to_token[pair[1]]
        if new_token not in token_to_id:
            token_to_id[new_token] = len(id_to_token)
            id_to_token.append(new_token)
        new_id = token_to_id[new_token]
        merges.append((pair, new_id))

        # Rewrite only the words this entry was pushed for; collect the pairs that appeared.
        created: defaultdict[Pair, set[int]] = defaultdict(set)
        for w in positions:
            for changed, delta in _merge_word(words[w], pair, new_id):
                pair_counts[changed] += delta * weight[w]
                if delta > 0:
                    created[changed].add(w)
        for changed, where_created in created.items():
            if pair_counts[changed] > 0:
                push(changed, pair_counts[changed], where_created)

    # subtle: a pair merged twice keeps its later rank (the library collects merges into a map).
    rank = {pair: r for r, (pair, _) in enumerate(merges)}
    ordered = sorted(rank, key=rank.get)
    return token_to_id, [(id_to_token[a], id_to_token[b]) for a, b in ordered]


def train_naive(
    counts: dict[str, int], vocab_size: int, special_tokens: list[str]
) -> tuple[dict[str, int], list[Pair]]:
    """The slow oracle: recount every pair of every word before each merge. Same choices, no heap.

    Correct by inspection and hopeless on real corpora (each merge costs a pass over all words);
    the tests and the benchmark compare `train` against it.
    """
    id_to_token = initial_vocab(counts, special_tokens)
    token_to_id = {token: i for i, token in enumerate(id_to_token)}
    words = [([token_to_id[ch] for ch in word], n) for word, n in counts.items()]
    merges = []
    while len(token_to_id) < vocab_size:
        pair_counts: Counter[Pair] = Counter()
        for word, n in words:
            for pair in zip(word, word[1:], strict=False):
                pair_counts[pair] += n
        if not pair_counts:
            break
        best = min(pair_counts, key=lambda p: (-pair_counts[p], p))  # most frequent, then smallest ids
        new_token = id_to_token[best[0]] + id_to_token[best[1]]
        if new_token not in token_to_id:
            token_to_id[new_token] = len(id_to_token)
            id_to_token.append(new_token)
        for word, _ in words:
            _merge_word(word, best, token_to_id[new_token])
        merges.append((id_to_token[best[0]], id_to_token[best[1]]))
    return token_to_id, merges
