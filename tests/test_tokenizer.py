"""The BPE tokenizer: training from each source, the saved folder, round trips, special tokens,
the chat template, the reference trainer's equality with the library, and clear errors."""

import hashlib
import json
import os
import string
import subprocess
import sys

import pytest
from conftest import run_without_package
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from deriv_lm.data import default_corpus, local_corpus
from deriv_lm.tokenization import SPECIAL_TOKENS, reference_bpe, save_tokenizer, train_bpe
from deriv_lm.tokenization.bpe import (
    CHAT_TEMPLATE,
    CHAT_TEMPLATE_WITHOUT_MARKS,
    ROLE_TOKENS,
    chat_template_with_generation_marks,
    to_transformers,
)


@pytest.fixture(scope="module")
def corpus_slice() -> list[str]:
    """The first ~200 KB of the default corpus: real English prose, fast to train on."""
    docs, size = [], 0
    for doc in default_corpus():
        docs.append(doc)
        size += len(doc)
        if size > 200_000:
            break
    return docs


@pytest.fixture(scope="module")
def trained(corpus_slice):
    tokenizer, summary = train_bpe(corpus_slice, vocab_size=1000, progress=False)
    return tokenizer, summary


@pytest.fixture(scope="module")
def hf_tokenizer(trained):
    return to_transformers(trained[0], model_max_length=128)


def corpus_digest(documents) -> str:
    return hashlib.sha256("\x1e".join(documents).encode()).hexdigest()


def test_default_corpus_is_deterministic_english_of_about_two_megabytes(tmp_path):
    documents = list(default_corpus())
    size = sum(map(len, documents))
    assert 1_500_000 < size < 6_000_000, size
    text = "".join(documents[:50])
    assert " the " in text and "function" in text
    # Same text in the same order in another process (a fresh parse of the standard library).
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import hashlib; from deriv_lm.data import default_corpus; "
            "print(hashlib.sha256('\\x1e'.join(default_corpus()).encode()).hexdigest())",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.stdout.strip() == corpus_digest(documents), result.stderr[-2000:]


def test_special_tokens_have_fixed_ids_first(trained):
    tokenizer, summary = trained
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert summary.vocab_size == tokenizer.get_vocab_size() == 1000


def test_special_token_ids_are_stable_across_retraining(corpus_slice):
    other, _ = train_bpe(
        corpus_slice[::-1][:40], vocab_size=700, special_tokens=[*SPECIAL_TOKENS, "<tool>"], progress=False
    )
    assert [other.token_to_id(t) for t in [*SPECIAL_TOKENS, "<tool>"]] == list(range(len(SPECIAL_TOKENS) + 1))


def test_special_tokens_are_never_split(hf_tokenizer):
    text = "<|user|>\nhello<eos><bos>x<|assistant|>"
    ids = hf_tokenizer(text).input_ids
    for token in ("<|user|>", "<eos>", "<bos>", "<|assistant|>"):
        assert hf_tokenizer.convert_tokens_to_ids(token) in ids
    assert hf_tokenizer.decode(ids) == text


def test_no_text_is_unknown_and_bytes_are_all_in_the_vocabulary(trained):
    tokenizer, _ = trained
    vocab = tokenizer.get_vocab()
    assert all(symbol in vocab for symbol in pre_tokenizers.ByteLevel.alphabet())
    assert tokenizer.decode(tokenizer.encode("\x00\x7f é 漢字 🤗").ids) == "\x00\x7f é 漢字 🤗"


unicode_text = st.lists(
    st.one_of(
        st.characters(codec="utf-8"),  # any encodable code point: CJK, emoji, combining marks, controls
        st.sampled_from(["\u0301", "\u200d", "👩‍🔬", "漢字", "\t", "\n", " " * 7, "\r\n", "\x00"]),
    ),
    max_size=100,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(unicode_text)
def test_decode_encode_round_trip(hf_tokenizer, text):
    ids = hf_tokenizer(text).input_ids
    assert hf_tokenizer.decode(ids) == text
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == text


@settings(max_examples=100, deadline=None)
@given(unicode_text, unicode_text)
def test_round_trip_with_special_tokens_inside(hf_tokenizer, left, right):
    text = left + "<eos>" + right
    ids = hf_tokenizer(text).input_ids
    assert hf_tokenizer.decode(ids) == text
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == left + right


@pytest.mark.slow
def test_folder_reloads_in_a_fresh_process_and_encodes_identically(trained, tmp_path):
    tokenizer, _ = trained
    folder = tmp_path / "tok"
    save_tokenizer(tokenizer, folder, model_max_length=128)
    names = {p.name for p in folder.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= names
    text = "Return the number of items in a container. 漢字 🤗"
    expected = tokenizer.encode(text).ids
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    result = run_without_package(
        f"""
        import json
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained({str(folder)!r})
        assert tok.model_max_length == 128 and tok.padding_side == "left", (tok.model_max_length, tok.padding_side)
        assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
        ids = tok({text!r}).input_ids
        assert ids == {expected!r}, ids
        assert tok.decode(ids) == {text!r}
        batch = tok(["a", "a longer line of text"], padding=True)
        assert batch.input_ids[0][0] == 0 and batch.attention_mask[0][0] == 0
        print(json.dumps(tok.apply_chat_template({messages!r}, tokenize=False, add_generation_prompt=True)))
        """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rendered = json.loads(result.stdout.strip().splitlines()[-1])
    assert rendered == "<bos><|system|>\nBe brief.<eos>\n<|user|>\nHi<eos>\n<|assistant|>\n"


def test_saved_config_is_readable_by_transformers_4(trained, tmp_path):
    save_tokenizer(trained[0], tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # 4.x does not know TokenizersBackend
    assert config["chat_template"] == CHAT_TEMPLATE  # 4.x before 4.50 reads the template from here only
    assert (tmp_path / "chat_template.jinja").read_text() == CHAT_TEMPLATE  # the one with the generation marks


def test_chat_template_rejects_unknown_roles(hf_tokenizer):
    with pytest.raises(Exception, match="Unknown chat role"):
        hf_tokenizer.apply_chat_template([{"role": "wizard", "content": "x"}], tokenize=False)


# ---- the chat template's generation marks ---------------------------------------------------------


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."}],
    [
        {"role": "system", "content": "You count.\nOnly digits."},
        {"role": "user", "content": "One?"},
        {"role": "assistant", "content": " 1, then\n2 漢字 🤗"},
        {"role": "user", "content": "And <eos> after?"},
        {"role": "assistant", "content": "3"},
    ],
]


def plain_rendering(messages: list[dict], add_generation_prompt: bool) -> str:
    """What Deriv's template has always written, in plain Python: the reference the marked template must equal."""
    blocks = "".join(f"<|{m['role']}|>\n{m['content']}<eos>\n" for m in messages)
    return "<bos>" + blocks + ("<|assistant|>\n" if add_generation_prompt else "")


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=lambda m: f"{len(m)}-messages")
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_the_generation_marks_leave_the_rendered_text_unchanged(hf_tokenizer, messages, add_generation_prompt):
    render = dict(tokenize=False, add_generation_prompt=add_generation_prompt)
    marked = hf_tokenizer.apply_chat_template(messages, **render)
    unmarked = hf_tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE_WITHOUT_MARKS, **render)
    assert "{% generation %}" in CHAT_TEMPLATE and hf_tokenizer.chat_template == CHAT_TEMPLATE
    assert marked == unmarked == plain_rendering(messages, add_generation_prompt)


def masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The runs of consecutive ids whose mask is 1: [5, 6, 7, 8], [0, 1, 1, 0] -> [[6, 7]]."""
    runs: list[list[int]] = []
    for i, (token, bit) in enumerate(zip(ids, mask, strict=True)):
        if bit:
            if i == 0 or not mask[i - 1]:
                runs.append([])
            runs[-1].append(token)
    return runs


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=lambda m: f"{len(m)}-messages")
def test_the_assistant_mask_is_the_replies_and_their_eos(hf_tokenizer, messages):
    out = hf_tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    replies = [m["content"] + "<eos>" for m in messages if m["role"] == "assistant"]
    assert [hf_tokenizer.decode(run) for run in masked_runs(ids, mask)] == replies  # the eos ends each run
    rest = "<bos>" + "".join(
        f"<|{m['role']}|>\n" + ("" if m["role"] == "assistant" else m["content"] + "<eos>") + "\n" for m in messages
    )
    assert hf_tokenizer.decode([token for token, bit in zip(ids, mask, strict=True) if not bit]) == rest
    roles = hf_tokenizer.convert_tokens_to_ids(ROLE_TOKENS)
    assert not any(bit for token, bit in zip(ids, mask, strict=True) if token in roles)  # headers are the prompt's
    assert mask[0] == 0 and ids[0] == hf_tokenizer.bos_token_id


def test_an_old_folder_renders_the_same_and_its_template_can_be_upgraded():
    folder = os.path.join(os.path.dirname(__file__), "data", "numbers_lm")  # saved before the marks
    old = AutoTokenizer.from_pretrained(folder)
    assert old.chat_template == CHAT_TEMPLATE_WITHOUT_MARKS
    for messages in CONVERSATIONS:
        assert old.apply_chat_template(messages, tokenize=False) == plain_rendering(messages, False)
    old.chat_template = chat_template_with_generation_marks(old.chat_template)
    out = old.apply_chat_template(CONVERSATIONS[2], return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert old.decode([t for t, bit in zip(ids, mask, strict=True) if bit]) == "Seven.<eos>"
    assert chat_template_with_generation_marks(CHAT_TEMPLATE) == CHAT_TEMPLATE
    mine = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert chat_template_with_generation_marks(mine) == mine  # someone else's template: only they know its turns
    assert chat_template_with_generation_marks(None) is None


def test_save_replaces_an_existing_tokenizer_but_keeps_other_files(trained, tmp_path):
    """Into a Deriv model folder (here one an earlier version wrote, without the marker): its tokenizer is
    replaced, its weights kept. A folder of the user's is refused (tests/test_output_dir.py)."""
    (tmp_path / "config.json").write_text('{"model_type": "deriv"}')
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "tokenizer.json").write_text("old")
    save_tokenizer(trained[0], tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == b"weights"
    assert AutoTokenizer.from_pretrained(tmp_path).vocab_size == 1000
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_interrupted_save_leaves_the_old_folder_intact(trained, tmp_path, monkeypatch):
    save_tokenizer(trained[0], tmp_path)
    before = (tmp_path / "tokenizer.json").read_bytes()

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("deriv_lm.tokenization.bpe.make_portable", boom)
    with pytest.raises(KeyboardInterrupt):
        save_tokenizer(trained[0], tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == before
    assert not [p for p in tmp_path.parent.iterdir() if ".partial-" in p.name]


# ---- the reference trainer -------------------------------------------------------------------


def library_merges(tokenizer) -> list[tuple[str, str]]:
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges]


def test_reference_pretokenizer_equals_the_library(corpus_slice):
    library = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    for doc in corpus_slice[:200] + ["it's  a\ttest\n\n  x 12,345 ¿qué? 漢字🤗  "]:
        assert reference_bpe.pretokenize(doc) == [piece for piece, _ in library.pre_tokenize_str(doc)]


def test_reference_trainer_matches_the_library_on_the_default_corpus(corpus_slice, trained):
    tokenizer, _ = trained
    counts = reference_bpe.word_counts(corpus_slice)
    vocab, merges = reference_bpe.train(counts, 1000, SPECIAL_TOKENS)
    assert merges == library_merges(tokenizer)  # same merges, same order
    assert vocab == tokenizer.get_vocab()


def test_reference_trainer_exports_the_same_tokenizer_json(corpus_slice, trained):
    from tokenizers import AddedToken, models

    from deriv_lm.tokenization.bpe import byte_level_tokenizer

    counts = reference_bpe.word_counts(corpus_slice)
    vocab, merges = reference_bpe.train(counts, 1000, SPECIAL_TOKENS)
    ours = byte_level_tokenizer(models.BPE(vocab=vocab, merges=merges))
    ours.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    assert json.loads(ours.to_str()) == json.loads(trained[0].to_str())


def test_heap_trainer_equals_the_naive_oracle():
    texts = [string.ascii_lowercase[i : i + 9] * (i % 4 + 1) + " the then there" for i in range(15)] * 3
    counts = reference_bpe.word_counts(texts)
    assert reference_bpe.train(counts, 320, SPECIAL_TOKENS) == reference_bpe.train_naive(counts, 320, SPECIAL_TOKENS)


def test_ties_go_to_the_smallest_pair():
    # Every adjacent pair occurs once: the first merge must be the pair of smallest ids, (a, b).
    vocab, merges = reference_bpe.train({"ab": 1, "cd": 1, "ef": 1}, 256 + 6 + 1, SPECIAL_TOKENS)
    assert merges == [("a", "b")]


# ---- bad input --------------------------------------------------------------------------------


def test_empty_corpus_is_an_error():
    with pytest.raises(ValueError, match="corpus is empty"):
        train_bpe(["", ""], vocab_size=500, progress=False)


def test_vocabulary_too_small_for_the_bytes_and_specials():
    with pytest.raises(ValueError, match="at least 262"):
        train_bpe(["some text"], vocab_size=261, progress=False)


def test_missing_text_column_lists_the_columns(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"body": "hello", "id": 1}\n')
    with pytest.raises(KeyError, match=r"no column 'text'; the columns are \['body', 'id'\]"):
        list(local_corpus(str(path)))


def test_non_utf8_file_names_the_file_and_offset(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt: not valid UTF-8 at byte 3"):
        list(local_corpus(str(path)))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        local_corpus(str(tmp_path / "nope.txt"))


def test_unreachable_dataset_says_so_and_suggests_local_files(tmp_path):
    # A fresh process, because the Hub libraries read HF_HUB_OFFLINE when they are imported.
    code = (
        "from deriv_lm.data import hub_corpus\n"
        "try:\n    hub_corpus('someone/not-a-cached-dataset')\n"
        "except ConnectionError as error:\n    print(error)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "Cannot load the dataset 'someone/not-a-cached-dataset'" in result.stdout, result.stderr[-2000:]
    assert "offline mode is on" in result.stdout and "--files" in result.stdout


def test_local_files_of_every_kind(tmp_path):
    (tmp_path / "a.txt").write_text("plain text file")
    (tmp_path / "b.jsonl").write_text('{"text": "from jsonl"}\n{"text": "second row"}\n')
    (tmp_path / "c.csv").write_text("text,other\nfrom csv,1\n")
    import datasets

    datasets.Dataset.from_dict({"text": ["from parquet"]}).to_parquet(str(tmp_path / "d.parquet"))
    docs = list(local_corpus(str(tmp_path)))
    assert docs == ["plain text file", "from jsonl", "second row", "from csv", "from parquet"]
    assert list(local_corpus(str(tmp_path / "*.jsonl"))) == ["from jsonl", "second row"]


def test_a_local_dataset_through_datasets(tmp_path):
    import datasets

    from deriv_lm.data import hub_corpus

    (tmp_path / "files").mkdir()
    datasets.Dataset.from_dict({"content": ["one", "two"]}).to_json(str(tmp_path / "files" / "part.jsonl"))
    corpus = hub_corpus(str(tmp_path / "files"), text_column="content")
    assert list(corpus) == ["one", "two"]
    assert list(hub_corpus(str(tmp_path / "files"), text_column="content", streaming=True)) == ["one", "two"]
    with pytest.raises(KeyError, match="columns are"):
        hub_corpus(str(tmp_path / "files"), text_column="text")


def test_characters_per_token_ignores_padding_left_on_by_a_batched_call(tiny_tokenizer):
    from deriv_lm.tokenization.bpe import characters_per_token

    texts = ["a short one", "a much longer text than the first, with many more tokens in it"]
    before = characters_per_token(tiny_tokenizer, texts)
    tiny_tokenizer(texts, padding=True)  # switches padding on in the backend tokenizer
    assert tiny_tokenizer.backend_tokenizer.padding is not None
    try:
        assert characters_per_token(tiny_tokenizer, texts) == before
    finally:
        tiny_tokenizer.backend_tokenizer.no_padding()  # the fixture is shared by the session
    tokens = sum(len(tiny_tokenizer(t, add_special_tokens=False).input_ids) for t in texts)
    assert before == sum(map(len, texts)) / tokens


def test_without_an_atomic_exchange_two_renames_still_replace_the_folder(trained, tmp_path, monkeypatch):
    """Where renameat2 is missing (not Linux), the swap is two renames; a kill between them leaves the previous
    version beside the folder, and the next write puts it back before it writes."""
    from deriv_lm.folder import atomic as files

    monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    folder = tmp_path / "tok"
    save_tokenizer(trained[0], folder)
    (folder / "model.safetensors").write_bytes(b"weights")
    save_tokenizer(trained[0], folder)
    assert (folder / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]

    # a kill between the two renames: the folder is gone, its previous version waits under a temporary name
    stranded = tmp_path / ".tok.old-99999999-dead"  # no process has this id
    folder.rename(stranded)
    save_tokenizer(trained[0], folder)
    assert (folder / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]
