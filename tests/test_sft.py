"""`deriv train sft`: conversations, the assistant-only loss, packing, the task on the driver, and its folder."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import cli_error, make_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from deriv_lm.data.conversations import (
    _default_rows,
    check_messages,
    default_conversations,
    first_paragraph,
    local_conversations,
)
from deriv_lm.training.args import ChatTrainingArguments
from deriv_lm.training.sft import chat_collator, encode_conversations, prepare_chat_tokenizer, train_sft


NUMBERS_LM = Path(__file__).parent / "data" / "numbers_lm"  # a tiny decoder trained on "5 3 : fifty three" lines
ONES = "zero one two three four five six seven eight nine".split()


def conversation(i: int) -> list[dict]:
    """A question of two digits and its answer in words; a system message on every third."""
    a, b = i % 10, (i * 7) % 10
    turns = [
        {"role": "user", "content": f"{a} {b}"},
        {"role": "assistant", "content": f"{ONES[a]} {ONES[b]}"},
    ]
    return ([{"role": "system", "content": "Spell the digits."}] if i % 3 == 0 else []) + turns


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": conversation(i)}) + "\n" for i in range(80)))
    return path


@pytest.fixture(scope="module")
def numbers_tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(NUMBERS_LM)
    prepare_chat_tokenizer(tokenizer)
    return tokenizer


def chat_args(tmp_path, chat_file, **overrides) -> ChatTrainingArguments:
    values = dict(
        output_dir=str(tmp_path / "chat"),
        init_from=str(NUMBERS_LM),
        files=[str(chat_file)],
        max_position_embeddings=64,
        batch_size=8,
        max_steps=4,
        warmup_steps=1,
        learning_rate=1e-3,
        log_every=2,
        eval_every=2,
        save_every=4,
        samples=2,
        validation_fraction=0.1,
        progress=False,
        dropout=0.0,
    )
    return ChatTrainingArguments(**{**values, **overrides})


# ---- the mask ---------------------------------------------------------------------------------------------


def test_labels_are_the_assistant_tokens_only(numbers_tokenizer):
    """System and user tokens (and the <|assistant|> header) are labelled -100; every token of each assistant
    message and the <eos> that ends it is its own label."""
    tokenizer = numbers_tokenizer
    messages = [
        {"role": "system", "content": "Spell the digits."},
        {"role": "user", "content": "4 2"},
        {"role": "assistant", "content": "four two"},
        {"role": "user", "content": "7"},
        {"role": "assistant", "content": "seven"},
    ]
    dataset, dropped = encode_conversations([tuple(messages)], tokenizer, 64)
    assert dropped == 0
    ids, labels = dataset[0]["input_ids"], dataset[0]["labels"]
    labelled = [i for i, label in enumerate(labels) if label != -100]
    assert all(labels[i] == ids[i] for i in labelled)
    taught = tokenizer.decode([ids[i] for i in labelled])
    assert taught == "four two<eos>seven<eos>"
    ignored = tokenizer.decode([ids[i] for i, label in enumerate(labels) if label == -100])
    for text in ("Spell the digits.", "4 2", "7", "<|system|>", "<|user|>", "<|assistant|>"):
        assert text in ignored


def test_longer_conversations_are_dropped_and_counted(numbers_tokenizer):
    rows = [tuple(conversation(1)), ({"role": "user", "content": "9 " * 40}, {"role": "assistant", "content": "x"})]
    dataset, dropped = encode_conversations(rows, numbers_tokenizer, 32)
    assert (len(dataset), dropped) == (1, 1)


def test_a_template_without_marks_is_refused():
    tokenizer = AutoTokenizer.from_pretrained(NUMBERS_LM)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="does not mark the assistant"):
        prepare_chat_tokenizer(tokenizer)


# ---- conversations ------------------------------------------------------------------------------------------


def test_local_jsonl_is_read_and_checked(chat_file):
    conversations = local_conversations([str(chat_file)])
    assert len(conversations.rows) == 80 and not conversations.synthetic
    assert conversations.rows[1] == tuple(conversation(1))


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "line 2: not valid JSON"),
        (json.dumps({"text": "hi"}), "line 2: no 'messages' field"),
        (json.dumps({"messages": [{"role": "bot", "content": "hi"}]}), "role 'bot'"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "no assistant message"),
        (json.dumps({"messages": [{"role": "assistant", "content": 3}]}), "must be text"),
        (json.dumps({"messages": []}), "non-empty list"),
    ],
)
def test_a_bad_conversation_is_named_by_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": conversation(1)}) + "\n" + line + "\n")
    with pytest.raises((ValueError, KeyError), match=message):
        local_conversations([str(path)])


def test_conversations_are_read_from_jsonl_only(tmp_path):
    path = tmp_path / "chat.txt"
    path.write_text("hello")
    with pytest.raises(ValueError, match=r"\.jsonl"):
        local_conversations([str(path)])
    with pytest.raises(FileNotFoundError, match="No such file"):
        local_conversations([str(tmp_path / "missing.jsonl")])


@pytest.mark.slow
def test_the_default_conversations_are_synthetic_checked_and_the_same_each_time():
    conversations = default_conversations()
    rows = conversations.rows
    assert conversations.synthetic and "synthetic" in conversations.description
    assert len(rows) > 1000
    for row in rows[::50]:
        assert check_messages(list(row), "default") == row
    roles = [tuple(m["role"] for m in row) for row in rows]
    assert ("user", "assistant") in roles and ("system", "user", "assistant") in roles
    assert any(r.count("assistant") == 2 for r in roles)  # some go on for a second turn
    answers = {row[-1]["content"] for row in rows}
    assert any(a.startswith("Assert statements") for a in answers)  # from the help() topics
    _default_rows.cache_clear()
    assert default_conversations().rows == rows  # built again from the sources: the same set


def test_first_paragraph_stops_at_a_blank_line_and_a_sentence():
    assert first_paragraph("Return the\nsum.\n\nMore text.") == "Return the sum."
    long = "A sentence. " * 50
    cut = first_paragraph(long, limit=40)
    assert cut == "A sentence. A sentence. A sentence." and len(cut) <= 40


# ---- packing -----------------------------------------------------------------------------------------------


def test_packed_conversations_do_not_see_each_other(numbers_tokenizer):
    """One packed row of several conversations gives the same loss, per assistant token, as the conversations
    padded in rows of their own: positions restart and attention stays within each conversation."""
    rows = [tuple(conversation(i)) for i in range(5)]
    dataset, _ = encode_conversations(rows, numbers_tokenizer, 64)
    features = [{k: dataset[i][k] for k in ("input_ids", "labels")} for i in range(len(dataset))]
    # a trained model: a random one attends almost uniformly, and a leak between conversations would hardly
    # move its loss (1e-5 here), where this one's moves by a tenth
    model = AutoModelForCausalLM.from_pretrained(NUMBERS_LM).eval()
    losses = {}
    for packing in (True, False):
        batch = chat_collator(numbers_tokenizer, packing)(features)
        if packing:
            assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
            assert (batch["position_ids"] == 0).sum() == len(rows)
        targets = int((batch["labels"] != -100).sum())
        with torch.no_grad():
            losses[packing] = model(**batch, num_items_in_batch=targets).loss.item()
    assert losses[True] == pytest.approx(losses[False], abs=1e-5)


# ---- the task --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory, chat_file):
    args = chat_args(tmp_path_factory.mktemp("sft"), chat_file, packing=True)
    train_sft(args, cpu=True)
    return Path(args.output_dir)


def test_sft_trains_and_exports_a_folder_that_chats(trained):
    model = AutoModelForCausalLM.from_pretrained(trained)
    tokenizer = AutoTokenizer.from_pretrained(trained)
    assert "{% generation %}" in tokenizer.chat_template
    run = json.loads((trained / "run.json").read_text())
    assert run["task"] == "chat-sft" and run["base_model"] == "numbers_lm"
    assert run["data"]["unit"] == "conversations" and not run["data"]["synthetic"]
    metrics = {**run["metrics"], **run["metrics"]["task"]}  # the task's own scores beside the validation loss
    assert metrics["val_loss"] < metrics["base_val_loss"]  # four steps on the task it is scored on
    assert len(metrics["conversations"]) == 2
    assert {"messages", "before", "after"} <= set(metrics["conversations"][0])
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "3 5"}], add_generation_prompt=True, return_tensors="pt"
    )
    out = model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]
    card = (trained / "README.md").read_text()
    assert "conversational" in card and "before fine-tuning" in card and "synthetic" not in card


def test_pipeline_with_messages_on_the_fine_tuned_folder(trained):
    from transformers import pipeline

    chat = pipeline("text-generation", model=str(trained))
    out = chat([{"role": "user", "content": "4 2"}], max_new_tokens=5, do_sample=False)
    reply = out[0]["generated_text"][-1]
    assert reply["role"] == "assistant" and isinstance(reply["content"], str)


def test_padding_by_length_trains_too(tmp_path, chat_file):
    args = chat_args(tmp_path, chat_file, packing=False, max_steps=2, eval_every=2, samples=0)
    train_sft(args, cpu=True)
    run = json.loads((tmp_path / "chat" / "run.json").read_text())
    assert run["training"]["steps"] == 2 and run["arguments"]["chat"]["packing"] is False


def test_an_imported_gpt2_without_chat_tokens_gains_them(tmp_path, chat_file, tiny_tokenizer):
    """GPT-2 imported with `deriv import` keeps a tokenizer with no chat template and no role tokens: it gets
    Deriv's template and the three tokens, and the model an embedding row for each."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from deriv_lm.convert import import_model

    gpt2 = tmp_path / "gpt2"
    config = GPT2Config(vocab_size=len(tiny_tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(gpt2)
    tiny_tokenizer.save_pretrained(gpt2)
    base = tmp_path / "imported"
    import_model(str(gpt2), str(base))
    assert AutoTokenizer.from_pretrained(base).chat_template is None
    args = chat_args(tmp_path, chat_file, init_from=str(base), max_steps=1, samples=0)
    train_sft(args, cpu=True)
    tuned = AutoTokenizer.from_pretrained(args.output_dir)
    model = AutoModelForCausalLM.from_pretrained(args.output_dir)
    assert len(tuned) == len(tiny_tokenizer) + 3 == model.config.vocab_size
    assert "{% generation %}" in tuned.chat_template
    ids = tuned.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>"])
    assert sorted(ids) == list(range(len(tiny_tokenizer), len(tiny_tokenizer) + 3))


def test_the_default_base_missing_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = cli_error(["train", "sft", "--max-steps", "1"], capsys)
    assert "runs/deriv-tiny" in message and "deriv train lm" in message
    assert not os.path.exists(tmp_path / "runs")


# ---- LoRA through PEFT ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, chat_file):
    """The same LoRA fine-tuning exported both ways: adapters merged into the weights, and set beside them."""
    pytest.importorskip("peft", reason="LoRA needs peft (pip install 'deriv-lm[lora]')")
    folders = {}
    for export in ("merged", "adapter"):
        args = chat_args(
            tmp_path_factory.mktemp(f"lora-{export}"), chat_file, lora=True, lora_export=export, learning_rate=1e-2
        )
        train_sft(args, cpu=True)
        folders[export] = Path(args.output_dir)
    return folders


def greedy_reply(model, tokenizer, text: str = "4 2") -> list[int]:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt"
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    return out[0, prompt["input_ids"].shape[1] :].tolist()


def test_lora_trains_only_the_adapters_on_peft_s_default_targets(lora_runs):
    run = json.loads((lora_runs["merged"] / "run.json").read_text())
    lora = run["procedure"]["task"]["lora"]
    assert lora["targets"] == ["q_proj", "v_proj"] and lora["r"] == 8 and lora["export"] == "merged"
    assert run["metrics"]["val_loss"] < run["metrics"]["task"]["base_val_loss"]
    base = AutoModelForCausalLM.from_pretrained(NUMBERS_LM).state_dict()
    tuned = AutoModelForCausalLM.from_pretrained(lora_runs["merged"]).state_dict()
    changed = {name for name, weight in tuned.items() if not torch.equal(weight, base[name])}
    assert changed and all(name.endswith(("q_proj.weight", "v_proj.weight")) for name in changed)
    assert not any("lora" in name for name in tuned)  # merged: a plain Deriv folder
    card = (lora_runs["merged"] / "README.md").read_text()
    assert "LoRA (PEFT)" in card and "merged into the weights" in card


def test_the_adapter_export_keeps_the_base_and_loads_to_the_same_replies(lora_runs):
    from peft import PeftModel

    from deriv_lm.folder.load import load_folder
    from deriv_lm.modeling_deriv.lora_targets import quiet_peft_deprecations

    folder = lora_runs["adapter"]
    assert (folder / "adapter" / "adapter_model.safetensors").exists()
    adapter_config = json.loads((folder / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == folder.name  # never a local path
    base = AutoModelForCausalLM.from_pretrained(folder)
    assert all(
        torch.equal(w, AutoModelForCausalLM.from_pretrained(NUMBERS_LM).state_dict()[n])
        for n, w in base.state_dict().items()
    )  # the folder's own weights are the base's
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with quiet_peft_deprecations():
        with_peft = PeftModel.from_pretrained(base, str(folder), subfolder="adapter").eval()
    loaded = load_folder(folder)  # what deriv chat / generate / serve use: the adapter merged in
    assert greedy_reply(with_peft, tokenizer) == greedy_reply(loaded.model, tokenizer)
    merged = AutoModelForCausalLM.from_pretrained(lora_runs["merged"]).eval()
    assert greedy_reply(merged, tokenizer) == greedy_reply(loaded.model, tokenizer)  # the same run, both exports
    assert 'subfolder="adapter"' in (folder / "README.md").read_text()


def test_a_pickled_adapter_is_not_loaded(tmp_path, lora_runs):
    """An adapter folder that offers only `adapter_model.bin` (a pickle, which can run code when loaded) is
    refused before PEFT would unpickle it."""
    import pickle

    from deriv_lm.folder.load import load_folder

    folder = tmp_path / "planted"
    shutil.copytree(lora_runs["adapter"], folder)
    (folder / "adapter" / "adapter_model.safetensors").unlink()
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    (folder / "adapter" / "adapter_model.bin").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ValueError, match="only a safetensors adapter"):
        load_folder(folder)
    assert not marker.exists()


def test_a_lora_run_resumed_from_a_checkpoint_ends_with_the_same_weights(tmp_path, chat_file, capsys, caplog):
    """The checkpoints hold the PEFT-wrapped model: a run that resumes from step 3 of 6 (its step-6 checkpoint
    gone) retrains steps 4 to 6 to the weights the uninterrupted run exported, adapters' dropout included."""
    pytest.importorskip("peft", reason="LoRA needs peft (pip install 'deriv-lm[lora]')")
    from safetensors.torch import load_file

    args = chat_args(tmp_path, chat_file, lora=True, max_steps=6, save_every=3, eval_every=6, samples=0)
    train_sft(args, cpu=True)
    first = load_file(os.path.join(args.output_dir, "model.safetensors"))
    shutil.rmtree(os.path.join(args.checkpoint_dir, "step-0000006"))
    capsys.readouterr()
    train_sft(
        chat_args(tmp_path, chat_file, lora=True, max_steps=6, save_every=3, eval_every=6, samples=0, resume=True),
        cpu=True,
    )
    assert "at step 3" in capsys.readouterr().out
    assert not [r for r in caplog.records if "Removed shared tensor" in r.getMessage()]  # the tied head: noise
    again = load_file(os.path.join(args.output_dir, "model.safetensors"))
    assert first.keys() == again.keys()
    for key in first:
        assert torch.equal(first[key], again[key]), key


def test_the_default_conversations_are_labelled_synthetic_in_the_card(tmp_path, chat_file):
    base = tmp_path / "long"  # the numbers tokenizer spells prose byte by byte: a context long enough for it
    make_model(vocab_size=300, max_position_embeddings=512).save_pretrained(base)
    AutoTokenizer.from_pretrained(NUMBERS_LM).save_pretrained(base)
    args = chat_args(
        tmp_path,
        chat_file,
        init_from=str(base),
        files=[],
        max_position_embeddings=512,
        max_conversations=40,
        max_steps=1,
    )
    train_sft(args, cpu=True)
    run = json.loads((Path(args.output_dir) / "run.json").read_text())
    assert run["data"]["synthetic"] and run["data"]["corpus"].startswith("default (synthetic)")
    assert "**The conversations are synthetic**" in (Path(args.output_dir) / "README.md").read_text()


@pytest.mark.parametrize("mode", ["FSDP", "DEEPSPEED"])
def test_lora_is_refused_where_the_weights_are_gathered_into_a_plain_model(mode):
    from accelerate.utils import DistributedType

    from deriv_lm.training.sft import check_lora_mode

    with pytest.raises(ValueError, match=f"--lora runs on one process or under DDP, not under {mode}"):
        check_lora_mode(DistributedType[mode])
    check_lora_mode(DistributedType.MULTI_CPU)  # DDP: allowed
    check_lora_mode(DistributedType.NO)


# ---- defaults that follow the base folder; refusals before the data is read ----------------------------------


def test_the_context_defaults_to_the_base_models_positions(tmp_path, chat_file):
    from deriv_lm.training.sft import ChatTask

    args = chat_args(tmp_path, chat_file, max_position_embeddings=None)  # numbers_lm has 64 positions, not 128
    ChatTask(args)
    assert args.max_position_embeddings == 64
    assert ChatTrainingArguments(init_from="x").max_position_embeddings is None  # until the task reads the folder
    assert ChatTrainingArguments().max_position_embeddings == 128  # a new model's


def test_a_context_longer_than_the_base_allows_is_refused_before_the_run_starts(tmp_path, chat_file, monkeypatch):
    from deriv_lm.training import sft

    monkeypatch.setattr(sft, "run", lambda *a, **k: pytest.fail("the run started"))
    args = chat_args(tmp_path, chat_file, max_position_embeddings=128)
    with pytest.raises(
        ValueError, match="--context-length 128 is longer than the 64 positions .* pass --context-length 64"
    ):
        sft.train_sft(args, cpu=True)
    assert not (tmp_path / "chat").exists()


def test_lora_without_peft_is_refused_before_the_run_starts(tmp_path, chat_file, monkeypatch):
    import sys

    from deriv_lm.errors import MissingExtra
    from deriv_lm.training import sft

    for name in [n for n in sys.modules if n == "peft" or n.startswith("peft.")] or ["peft"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if PEFT were not installed
    monkeypatch.setattr(sft, "run", lambda *a, **k: pytest.fail("the run started"))
    with pytest.raises(MissingExtra, match=r"deriv train sft --lora needs the lora extra: pip install"):
        sft.train_sft(chat_args(tmp_path, chat_file, lora=True), cpu=True)


def test_an_empty_reply_shows_as_empty_not_as_quotes():
    from deriv_lm.training.sft import shown

    assert shown("") == "(empty)"
    assert shown("5 3") == "'5 3'"


def test_an_empty_reply_shows_as_empty_in_the_card_too():
    from deriv_lm.training.sft import card_text

    data = dict(corpus="c", train=1, validation=1, dropped_too_long=0, context_length=64, synthetic=False)
    asked = [{"role": "user", "content": "5 3"}]
    scores = {"base_val_loss": 1.0, "conversations": [{"messages": asked, "before": "", "after": "fifty three"}]}
    card = card_text(data, {"val_loss": None}, scores, None)
    assert "| 5 3 | (empty) | fifty three |" in card["evaluation"]
