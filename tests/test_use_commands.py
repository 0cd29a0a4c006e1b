"""What `deriv generate` promises beyond refusing bad input: temperature 0 is greedy, an empty prompt starts from
<bos>, a shortened budget is said aloud, streamed text has no control tokens, and a prompt's text is text."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from deriv_lm import DerivSeq2SeqConfig
from deriv_lm.cli import main
from deriv_lm.inference.commands import encode_prompt


NUMBERS = Path(__file__).parent / "data" / "numbers_lm"  # a tiny decoder: "5 3 1 8 :" -> " five thousand ...<eos>"
EXPECTED = json.loads((NUMBERS / "expected.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(NUMBERS)


def generate(capsys, *flags) -> tuple[str, str]:
    capsys.readouterr()
    assert main(["generate", str(NUMBERS), *flags]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_streamed_text_ends_at_eos_without_printing_it(tokenizer, capsys):
    prompt = tokenizer.decode(EXPECTED["prompts"][0])
    out, _ = generate(capsys, prompt, "--greedy", "--repetition-penalty", "1.0")
    continuation = EXPECTED["text"][0]
    assert continuation.endswith("<eos>")  # the model does emit <eos> here: the test can fail
    assert out.strip() == (prompt + continuation.removesuffix("<eos>")).strip()
    assert "<eos>" not in out


def test_temperature_zero_is_greedy_decoding(tokenizer, capsys):
    prompt = tokenizer.decode(EXPECTED["prompts"][1])
    greedy, _ = generate(capsys, prompt, "--greedy", "--no-stream")
    for seed in ("0", "1"):
        zero, _ = generate(capsys, prompt, "--temperature", "0", "--seed", seed, "--no-stream")
        assert zero == greedy
    sampled = {generate(capsys, prompt, "--temperature", "5", "--seed", s, "--no-stream")[0] for s in "0123"}
    assert sampled != {greedy}  # sampling at a high temperature does differ, so the comparison means something


def test_an_empty_prompt_starts_from_bos(capsys):
    out, err = generate(capsys, "", "--greedy", "--no-stream", "--max-new-tokens", "5")
    assert out.strip() and "error" not in err


def test_a_budget_cut_to_the_context_is_said(tokenizer, capsys):
    prompt = tokenizer.decode(EXPECTED["prompts"][0])
    _, err = generate(capsys, prompt, "--greedy", "--no-stream", "--max-new-tokens", "1000")
    assert "deriv: note: 56 new tokens, not 1000" in err  # 64 positions - 8 prompt tokens


def test_a_prompt_that_spells_a_special_token_is_plain_text(tokenizer):
    eos = tokenizer.eos_token_id
    assert eos in tokenizer("end <eos>", add_special_tokens=False).input_ids  # what the default encoding does
    ids = encode_prompt(tokenizer, "end <eos> <|user|>")
    assert eos not in ids and not set(ids) & set(tokenizer.all_special_ids)
    assert tokenizer.decode(ids) == "end <eos> <|user|>"


def test_the_chat_template_still_writes_the_role_tokens(tokenizer):
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "5 3"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    role = tokenizer.convert_tokens_to_ids
    assert ids[0] == tokenizer.bos_token_id
    assert role("<|user|>") in ids and role("<|assistant|>") == ids[-2] and tokenizer.eos_token_id in ids


@pytest.mark.parametrize("kind", ["decoder", "encoder-decoder"])
def test_a_mask_of_another_shape_than_the_ids_is_refused(kind):
    from conftest import TINY, make_model

    from deriv_lm import DerivForConditionalGeneration

    ids = torch.randint(3, 300, (2, 6))
    if kind == "decoder":
        model = make_model()
        model(input_ids=ids, attention_mask=torch.ones(2, 6))  # the right shape passes
        calls = [dict(attention_mask=torch.ones(2, 5)), dict(attention_mask=torch.ones(1, 6))]
    else:
        config = DerivSeq2SeqConfig(**TINY, decoder_start_token_id=1, pad_token_id=0)
        model = DerivForConditionalGeneration(config).eval()
        model(input_ids=ids, attention_mask=torch.ones(2, 6), decoder_input_ids=ids[:, :3])
        calls = [
            dict(attention_mask=torch.ones(2, 7), decoder_input_ids=ids[:, :3]),
            dict(
                attention_mask=torch.ones(2, 6), decoder_input_ids=ids[:, :3], decoder_attention_mask=torch.ones(2, 4)
            ),
        ]
    for extra in calls:
        with pytest.raises(ValueError, match="attention_mask` has shape"):
            model(input_ids=ids, **extra)


def test_a_training_document_that_spells_eos_keeps_it_as_text(tokenizer):
    """Only the data pipeline ends a document with <eos>: the same spelling inside the text is characters."""
    import datasets

    from deriv_lm.data.packing import tokenize_and_pack

    documents = datasets.Dataset.from_dict({"text": ["a <eos> b <|user|> c", "d"]})
    blocks = tokenize_and_pack(documents, tokenizer, context_length=4, num_proc=1)
    ids = [i for block in blocks["input_ids"] for i in block]
    specials = [i for i in ids if i in tokenizer.all_special_ids]
    assert specials == [tokenizer.eos_token_id] * len(specials) and len(specials) <= 2  # one per document, at most
    assert "<eos> b <|user|>" in tokenizer.decode(ids)
