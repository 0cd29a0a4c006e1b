"""TRL's SFTTrainer on Deriv: a few steps of chat fine-tuning on the CPU with the loss on the assistant's tokens
only, which TRL takes from the chat template's `{% generation %}` marks; offline throughout.

The model is the tiny decoder of conftest.py and the tokenizer the tiny byte-level BPE with Deriv's chat template
(tokenization/bpe.py), the one every tokenizer folder carries."""

import copy
import dataclasses
import socket

import pytest
import torch


trl = pytest.importorskip("trl", reason="TRL is not installed (the trl extra)")

from conftest import make_model  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from deriv_lm.tokenization.bpe import CHAT_TEMPLATE, CHAT_TEMPLATE_WITHOUT_MARKS  # noqa: E402


CONVERSATIONS = [
    [
        {"role": "system", "content": "be brief."},
        {"role": "user", "content": "the quick brown fox?"},
        {"role": "assistant", "content": "jumps over the lazy dog."},
        {"role": "user", "content": "and then?"},
        {"role": "assistant", "content": "a transformer attends."},
    ],
    [
        {"role": "user", "content": "what does it attend to?"},
        {"role": "assistant", "content": "to every token."},
    ],
    [
        {"role": "system", "content": "answer in one word."},
        {"role": "user", "content": "the lazy what?"},
        {"role": "assistant", "content": "dog."},
    ],
    [
        {"role": "user", "content": "who jumps?"},
        {"role": "assistant", "content": "the quick brown fox."},
    ],
]


# TRL turns activation checkpointing on by default under the name transformers 5.24 deprecates,
# `gradient_checkpointing`; the test asks for it under the name the installed transformers reads.
CONTEXT = 128
FIELDS = {field.name for field in dataclasses.fields(SFTConfig)}
CHECKPOINTING = "activation_checkpointing" if "activation_checkpointing" in FIELDS else "gradient_checkpointing"


@pytest.fixture
def chat_tokenizer(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)  # the session's tokenizer stays as it was
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture
def no_network(monkeypatch) -> list:
    """The addresses anything tried to connect to (each refused): TRL and the Hub client must need none."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    tried, connect = [], socket.socket.connect

    def refuse(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            tried.append(address)
            raise OSError(f"no network in this test: {address}")
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", refuse)
    return tried


def sft_trainer(model, tokenizer, tmp_path) -> SFTTrainer:
    args = SFTConfig(
        output_dir=str(tmp_path / "sft"),
        assistant_only_loss=True,
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        max_length=CONTEXT,  # TRL truncates longer examples, silently: the longest here is 104 tokens
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        push_to_hub=False,
        use_cpu=True,
        disable_tqdm=True,
        **{CHECKPOINTING: True},
    )
    return SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict({"messages": CONVERSATIONS}),
        processing_class=tokenizer,
    )


def test_sft_trains_a_deriv_model_on_conversations(chat_tokenizer, tmp_path, no_network):
    model = make_model(max_position_embeddings=CONTEXT)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = sft_trainer(model, chat_tokenizer, tmp_path)
    trainer.train()

    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert trainer.state.global_step == 3 and len(losses) == 3
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(not torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert no_network == []


def test_the_loss_covers_the_assistants_replies_and_their_eos_only(chat_tokenizer, tmp_path, no_network):
    trainer = sft_trainer(make_model(max_position_embeddings=CONTEXT), chat_tokenizer, tmp_path)
    for example, conversation in zip(trainer.train_dataset, CONVERSATIONS, strict=True):
        batch = trainer.data_collator([example])
        ids, labels = batch["input_ids"][0], batch["labels"][0]
        trained = labels != -100
        assert torch.equal(labels[trained], ids[trained])
        # The trained tokens, read back, are the replies in order, each ending at <eos>; nothing of the system or
        # user turns, nor the role headers, is trained.
        replies = [m["content"] + chat_tokenizer.eos_token for m in conversation if m["role"] == "assistant"]
        assert chat_tokenizer.decode(ids[trained]) == "".join(replies)
        # The same mask as the tokenizer's own, from the template's generation marks.
        rendered = chat_tokenizer.apply_chat_template(
            conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert trained.tolist() == [bool(m) for m in rendered["assistant_masks"]]
    assert no_network == []


def test_without_generation_marks_trl_refuses_the_assistant_only_loss(chat_tokenizer, tmp_path, no_network):
    """A folder made before issue 19 carries the same template without marks: TRL cannot find the replies in it."""
    chat_tokenizer.chat_template = CHAT_TEMPLATE_WITHOUT_MARKS
    with pytest.raises((ValueError, RuntimeError), match="chat template"):  # TRL 1.16 on construction, 1.0 on the data
        sft_trainer(make_model(max_position_embeddings=CONTEXT), chat_tokenizer, tmp_path)
