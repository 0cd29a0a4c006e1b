"""Shared fixtures: tiny configs and models (CPU, seconds), a tiny byte-level tokenizer, and a
helper that runs Python in a subprocess that cannot import this package."""

import json
import subprocess

import pytest
import torch

from deriv_lm import DerivConfig, DerivForCausalLM


TINY = dict(
    vocab_size=300,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    dropout=0.0,
)


# The encoder-decoder's tiny shape, for the tests that build one.
TINY_SEQ2SEQ = dict(
    vocab_size=300,
    hidden_size=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=48,
    dropout=0.0,
)


@pytest.fixture
def tiny_config() -> DerivConfig:
    return DerivConfig(**TINY)


def make_model(seed: int = 0, **overrides) -> DerivForCausalLM:
    torch.manual_seed(seed)
    return DerivForCausalLM(DerivConfig(**{**TINY, **overrides})).eval()


@pytest.fixture
def tiny_model() -> DerivForCausalLM:
    return make_model()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A byte-level BPE of 300 ids (pad=0, bos=1, eos=2, then bytes and a few merges), built in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = ["the quick brown fox jumps over the lazy dog. " * 4, "a transformer attends to every token. " * 4]
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", padding_side="left"
    )


def run_without_package(code: str, tmp_path, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter that cannot import deriv_lm, offline, from an empty directory
    (the same runner `deriv check` uses)."""
    from deriv_lm.hub_card.check import run_as_hub_user

    return run_as_hub_user(code, tmp_path, timeout=timeout)


def cli_error(argv: list[str], capsys) -> str:
    """Run `deriv argv` in this process; assert it refused with exit status 2 and return its `deriv: error:` line."""
    from deriv_lm.cli import main

    capsys.readouterr()
    assert main(argv) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("deriv: error: "), line
    return line


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    """120 documents of the default corpus as JSON lines: the training tests' corpus."""
    from deriv_lm.tokenization import default_corpus

    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    with open(path, "w") as f:
        for i, doc in enumerate(default_corpus()):
            if i >= 120:
                break
            f.write(json.dumps({"text": doc}) + "\n")
    return path
