"""The chat fine-tuning task (supervised fine-tuning): conversations, a loss on the assistant's tokens only.

conversations (local .jsonl `messages`, a `datasets` dataset, or the embedded synthetic default)
  --seeded split--> train / validation                 (before anything is trained on them)
  --the folder's chat template--> ids, and the mask of the assistant's tokens ({% generation %} in the template)
  --labels--> the ids where the mask is 1, -100 elsewhere: system and user tokens are read, never predicted
  --padded rows of similar length, or packed (one row per micro-batch, positions restarting per conversation)
  --driver--> the --init-from model fine-tuned (every weight, or LoRA adapters through PEFT), exported

What the loss is, for a conversation x with assistant mask m:  L = - sum_t m_t log p(x_t | x_<t) / sum_t m_t,
averaged over every assistant token of the accumulation window (the trainer's exact mean).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import random
import shutil
import tempfile

import torch
from accelerate import PartialState

from ..data.conversations import default_conversations, hub_conversations, local_conversations
from ..data.packing import LengthGroupedSampler
from ..errors import MissingExtra, UsageError, require_extra
from ..modeling_deriv import DerivForCausalLM
from ..tokenization.bpe import CHAT_TEMPLATE, ROLE_TOKENS, chat_template_with_generation_marks
from ..tokenization.chat_template import check_chat_template, render_chat
from .driver import run
from .lm import LanguageModelTask, fit_context_to_base
from .task import Outcome, Source, Task, TaskData


def conversations_from_args(args):
    """The conversations `args` name: --files (.jsonl), --dataset, or the embedded synthetic default."""
    if args.files:
        return local_conversations(args.files, args.messages_column)
    if args.dataset:
        return hub_conversations(args.dataset, args.dataset_config, args.split, args.messages_column)
    return default_conversations()


def prepare_chat_tokenizer(tokenizer, where: str = "the tokenizer") -> list[str]:
    """Make `tokenizer` able to give the assistant-token mask; returns the special tokens it had to add.

    A Deriv folder's template is upgraded to the one with `{% generation %}` marks (the same text). A tokenizer
    with no template at all (GPT-2's, through `deriv import`) gets Deriv's, its role tokens, and a pad token."""
    added = []
    if tokenizer.chat_template is None:
        tokenizer.chat_template = CHAT_TEMPLATE
        added = [t for t in ROLE_TOKENS if t not in tokenizer.get_vocab()]
        if added:
            tokenizer.add_special_tokens({"additional_special_tokens": added}, replace_extra_special_tokens=False)
    tokenizer.chat_template = chat_template_with_generation_marks(tokenizer.chat_template)
    if "generation" not in tokenizer.chat_template:
        raise UsageError(
            "The tokenizer's chat template does not mark the assistant's messages ({% generation %} ... "
            "{% endgeneration %}), so the loss cannot be limited to them; add the marks to chat_template.jinja."
        )
    check_chat_template(tokenizer, where)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return added


def encode_conversations(rows, tokenizer, context_length: int):
    """(dataset of `input_ids`, `labels`, `length`; conversations dropped as longer than `context_length`).

    Longer conversations are dropped, not cut: a cut reply would teach the model to stop mid-sentence."""
    import datasets

    def encode(row):
        out = render_chat(  # within a budget: an --init-from folder's template cannot hang the run
            tokenizer,
            row["messages"],
            return_dict=True,
            return_assistant_tokens_mask=True,
            tokenizer_kwargs={"verbose": False},  # a long conversation is dropped below, not warned about
        )
        ids, mask = out["input_ids"], out["assistant_masks"]
        labels = [token if keep else -100 for token, keep in zip(ids, mask, strict=True)]
        return {"input_ids": ids, "labels": labels, "length": len(ids)}

    table = datasets.Dataset.from_list([{"messages": list(row)} for row in rows])
    encoded = table.map(encode, remove_columns=["messages"], desc="applying the chat template")
    kept = encoded.filter(lambda n: n <= context_length, input_columns="length", desc="dropping long conversations")
    return kept, len(encoded) - len(kept)


def chat_collator(tokenizer, packing: bool):
    """transformers' collators: `DataCollatorWithFlattening` (packing: one row, position ids restarting per
    conversation, no attention mask) or `DataCollatorForSeq2Seq` without a model (right padding: pad ids, a 0
    mask, labels -100).

    subtle: transformers' mask builder reads packed rows from the position ids (each restart begins another
    sequence, and the causal mask becomes block-diagonal) only when no attention mask and no cache is passed.
    The model makes a cache whenever `use_cache` is on, its config's default, and with one each conversation of a
    packed row would attend to those before it; so a packed batch says `use_cache=False`."""
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

    if packing:
        flatten = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
        return lambda features: {**flatten(features), "use_cache": False}
    right = copy.copy(tokenizer)
    right.padding_side = "right"
    return DataCollatorForSeq2Seq(right, model=None, label_pad_token_id=-100)


@torch.no_grad()
def assistant_loss(model, dataset, collator, batch_size: int) -> float:
    """Mean loss per assistant token of `model` on `dataset` (the validation split): the score before training."""
    was_training, total, count = model.training, 0.0, 0
    model.eval()
    for start in range(0, len(dataset), batch_size):
        batch = collator([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
        batch = {k: v.to(model.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        targets = int((batch["labels"] != -100).sum())
        total += model(**batch, num_items_in_batch=targets).loss.item() * targets
        count += targets
    model.train(was_training)
    return total / max(count, 1)


@torch.no_grad()
def replies(model, tokenizer, conversations, max_new_tokens: int) -> list[str]:
    """Greedy replies to each conversation's messages before its last assistant message."""
    out = []
    for messages in conversations:
        prompt = render_chat(tokenizer, list(messages), add_generation_prompt=True, return_tensors="pt")
        ids = prompt["input_ids"].to(model.device)
        room = model.config.max_position_embeddings - ids.shape[1]
        generated = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max(1, min(max_new_tokens, room)),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            repetition_penalty=1.1,
        )
        out.append(tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True).strip())
    return out


class ChatTask(Task):
    """Supervised fine-tuning on conversations; the validation loss is per assistant token."""

    name = "chat-sft"
    model_class = DerivForCausalLM
    build_model = LanguageModelTask.build_model  # a new model from the flags (only without --init-from)
    generation_config = LanguageModelTask.generation_config

    def __init__(self, args):
        super().__init__(args)
        fit_context_to_base(args)  # what every later step reads: the tokenizer, the data, the model

    def read(self) -> Source:
        a = self.args
        conversations = conversations_from_args(a)
        rows = list(conversations.rows[: a.max_conversations])
        random.Random(a.seed).shuffle(rows)
        held_out = max(1, round(len(rows) * a.validation_fraction))
        if len(rows) - held_out < 1:
            raise UsageError(f"{conversations.description} gives {len(rows)} conversation(s); at least 2 needed")
        splits = {"validation": rows[:held_out], "train": rows[held_out:], "synthetic": conversations.synthetic}
        return Source(
            splits,
            lambda: (m["content"] for row in splits["train"] for m in row),
            lambda: [m["content"] for row in splits["train"][:300] for m in row],
            conversations.description,
        )

    def prepare(self, source: Source, tokenizer) -> TaskData:
        """The conversations encoded with the chat template (the tokenizer gains its marks, and role tokens
        where it had no template: `from_folder` grows the model's embeddings to match)."""
        a, splits, context = self.args, source.splits, self.args.max_position_embeddings
        prepare_chat_tokenizer(tokenizer, a.init_from or "the tokenizer")
        train, too_long_train = encode_conversations(splits["train"], tokenizer, context)
        validation, too_long_val = encode_conversations(splits["validation"], tokenizer, context)
        too_long = too_long_train + too_long_val
        if len(train) == 0 or len(validation) == 0:
            raise UsageError(
                f"No {'training' if len(train) == 0 else 'validation'} conversation fits --context-length "
                f"{context}; pass a longer --context-length or shorter conversations."
            )
        order = None if a.packing else LengthGroupedSampler(list(train["length"]), a.batch_size, a.seed)
        by_length = sorted(range(len(validation)), key=list(validation["length"]).__getitem__)
        train = train.remove_columns("length")
        validation = validation.select(by_length).remove_columns("length")
        self.say(
            f"data: {source.description}: {len(train)} / {len(validation)} train / validation "
            f"conversations; {too_long} dropped as longer than {context} tokens"
        )
        record = dict(
            corpus=source.description,
            dataset=a.dataset if a.dataset else None,
            unit="conversations",
            train=len(train),
            validation=len(validation),
            test=None,
            context_length=context,
            dropped_too_long=too_long,
            synthetic=splits["synthetic"],
        )
        collator = chat_collator(tokenizer, a.packing)
        return TaskData(train, validation, collator, order, None, "conversations", "assistant tokens", record)

    def from_folder(self, model, tokenizer):
        """Role tokens the tokenizer just gained get new embedding rows, the mean of the others (transformers'
        `mean_resizing`), so that their first logits are ordinary; the tied output projection grows with them."""
        if len(tokenizer) > model.config.vocab_size:
            added = tokenizer.convert_ids_to_tokens(list(range(model.config.vocab_size, len(tokenizer))))
            self.say(f"adding embedding rows for {', '.join(added)} (the mean of the existing rows)")
            model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
        return super().from_folder(model, tokenizer)

    def start(self, model, tokenizer, source, data):
        """The model's score and replies before fine-tuning (kept in `data.before`), then LoRA's adapters."""
        a, reply_tokens = self.args, self._reply_tokens()
        base_val_loss = assistant_loss(model, data.validation, data.collator, a.batch_size)
        self.say(f"before fine-tuning: validation loss {base_val_loss:.4f} per assistant token")
        shown = prompts_that_fit(source.splits["validation"], tokenizer, a, reply_tokens)
        before = {
            "base_val_loss": base_val_loss,
            "shown": shown,
            "replies": replies(model, tokenizer, shown, reply_tokens),
        }
        if a.lora:
            check_lora_mode(PartialState().distributed_type)
            model = with_lora(model, a, self.say)
            before["lora_targets"] = sorted(model.peft_config["default"].target_modules)
        return model, dataclasses.replace(data, before=before)

    def _reply_tokens(self) -> int:
        return min(64, self.args.max_position_embeddings // 2)

    def finish(self, model, state_dict, tokenizer, source, data, metrics) -> Outcome:
        """The replies after fine-tuning; the folder's model (LoRA's adapters merged in, or set aside in
        `adapter/`); the scores before and after."""
        a, before = self.args, data.before
        after = replies(model, tokenizer, before["shown"], self._reply_tokens())
        write_files = None
        if a.lora and a.lora_export == "merged":
            model, state_dict = model.merge_and_unload(), None
        elif a.lora:
            adapter = tempfile.mkdtemp(prefix="deriv-adapter-")
            model.save_pretrained(adapter)  # adapter_config.json + adapter_model.safetensors
            model, state_dict = model.unload(), None  # the base weights, without the adapters
            write_files = functools.partial(copy_adapter, adapter, os.path.basename(os.path.abspath(a.output_dir)))
        model = self.ready(model, tokenizer)
        conversations = [
            {"messages": list(shown), "before": b, "after": r}
            for shown, b, r in zip(before["shown"], before["replies"], after, strict=True)
        ]
        scores = {"base_val_loss": before["base_val_loss"], "conversations": conversations}
        lora = None
        if a.lora:
            settings = dict(r=a.lora_r, alpha=a.lora_alpha, dropout=a.lora_dropout, export=a.lora_export)
            lora = {**settings, "targets": before["lora_targets"]}
        return Outcome(
            model,
            state_dict,
            metrics=scores,
            procedure={"lora": lora} if lora else {},
            card=card_text(data.record, metrics, scores, lora),
            samples=[
                f"--- user: {c['messages'][-1]['content']!r}\n    before: {shown(c['before'])}\n"
                f"    after:  {shown(c['after'])}"
                for c in conversations
            ],
            write_files=write_files,
        )


def shown(reply: str) -> str:
    """A reply as the run's last lines show it: quoted, or `(empty)` for a model that said nothing (`''` reads
    as a printing fault)."""
    return repr(reply) if reply else "(empty)"


def copy_adapter(adapter_dir: str, base: str, folder: str) -> None:
    """--lora-export adapter: the adapter in FOLDER/adapter, naming its base `base` (the folder's name, a Hub id
    once published), never the local path it was trained from."""
    target = os.path.join(folder, "adapter")
    shutil.copytree(adapter_dir, target)
    shutil.rmtree(adapter_dir, ignore_errors=True)
    set_adapter_base(target, base)


def card_text(data: dict, metrics: dict, scores: dict, lora: dict | None) -> dict:
    """The card's words on a chat fine-tuning run (`folder.record.CardRecord`)."""
    text = (
        f"{data['corpus']}: {data['train']:,} training and {data['validation']:,} validation conversations; "
        f"{data['dropped_too_long']} dropped as longer than {data['context_length']} tokens. The loss is on the "
        "assistant's tokens only (the chat template's `{% generation %}` marks); system and user tokens are "
        "read, never predicted.\n"
    )
    if data["synthetic"]:
        text += (
            "\n**The conversations are synthetic**: made by a program from text that ships with Python, not "
            "written or checked by people. They teach the shape of a reply, not facts beyond that text.\n"
        )
    evaluation = []
    if metrics["val_loss"] is not None:
        evaluation.append(
            f"Validation loss per assistant token: {scores['base_val_loss']:.4f} before fine-tuning, "
            f"**{metrics['val_loss']:.4f}** after (perplexity {metrics['val_perplexity']:.2f}).\n"
        )
    if scores["conversations"]:
        cell = lambda s: (s or "(empty)").replace("|", "\\|").replace("\n", " ")  # noqa: E731
        evaluation.append("Greedy replies to held-out prompts, before and after fine-tuning:\n")
        evaluation.append("| prompt | before | after |\n| --- | --- | --- |")
        evaluation += [
            f"| {cell(c['messages'][-1]['content'])} | {cell(c['before'])} | {cell(c['after'])} |"
            for c in scores["conversations"]
        ]
        evaluation.append("")
    procedure, usage = [], CHAT_USAGE
    if lora:
        kept = "merged into the weights" if lora["export"] == "merged" else "beside the base weights, in `adapter/`"
        targets = ", ".join(f"`{t}`" for t in lora["targets"])
        procedure.append(
            [
                "LoRA (PEFT)",
                f"rank {lora['r']}, alpha {lora['alpha']}, dropout {lora['dropout']}, on {targets}; {kept}",
            ]
        )
        usage = ADAPTER_USAGE if lora["export"] == "adapter" else CHAT_USAGE
    return dict(
        kind="decoder-only chat model",
        tags=["conversational", "sft"] + (["lora"] if lora else []),
        data=text,
        procedure=procedure,
        evaluation="\n".join(evaluation),
        usage=usage,
        limitations=(
            "A chat model fine-tuned on the conversations above, for studying how such models work. It has not "
            "been aligned or filtered beyond them and can produce false or offensive text."
        ),
    )


CHAT_USAGE = """```python
from transformers import pipeline

chat = pipeline("text-generation", model="{repo}", trust_remote_code=True)
messages = [{"role": "user", "content": "What does `os.path.join` do?"}]
print(chat(messages, max_new_tokens=64)[0]["generated_text"][-1]["content"])
```

The conversation is rendered with the folder's chat template (`chat_template.jinja`); `deriv chat {repo}` talks with
it in a terminal."""

ADAPTER_USAGE = """```python
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

base = AutoModelForCausalLM.from_pretrained("{repo}", trust_remote_code=True)  # the weights before fine-tuning
model = PeftModel.from_pretrained(base, "{repo}", subfolder="adapter").merge_and_unload()
tokenizer = AutoTokenizer.from_pretrained("{repo}")
chat = pipeline("text-generation", model=model, tokenizer=tokenizer)
messages = [{"role": "user", "content": "What does `os.path.join` do?"}]
print(chat(messages, max_new_tokens=64)[0]["generated_text"][-1]["content"])
```

The folder holds the base model's weights and, in `adapter/`, the LoRA adapter trained on them: loading the folder
without PEFT gives the model before fine-tuning. `deriv chat {repo}` merges the adapter itself."""


def prompts_that_fit(rows, tokenizer, args, reply_tokens: int) -> list[tuple[dict, ...]]:
    """The first `args.samples` validation conversations cut before their last assistant message whose prompt
    leaves room for a reply of `reply_tokens` in the context: what the run shows before and after training."""
    shown = []
    for row in rows:
        if len(shown) == args.samples:
            break
        prompt = row[: max(i for i, m in enumerate(row) if m["role"] == "assistant")]
        ids = render_chat(tokenizer, list(prompt), add_generation_prompt=True, tokenizer_kwargs={"verbose": False})
        if len(ids["input_ids"]) + reply_tokens <= args.max_position_embeddings:
            shown.append(prompt)
    return shown


def check_lora_mode(mode) -> None:
    """LoRA runs on one process or under DDP. Under FSDP and DeepSpeed the exported weights are gathered into a
    plain model, which the adapters' names do not fit; refused before any step is spent."""
    from accelerate.utils import DistributedType

    if mode in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise UsageError(
            f"--lora runs on one process or under DDP, not under {mode.value}; launch without FSDP / DeepSpeed "
            "(LoRA's memory saving is in the optimizer state already), or fine-tune every weight"
        )


def with_lora(model, args, say=print):
    """`model` with LoRA adapters (PEFT), only they trainable; the targets default to PEFT's lookup for Deriv."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        raise MissingExtra("deriv train sft --lora", "lora") from error
    from ..modeling_deriv.lora_targets import quiet_peft_deprecations, register_peft_targets

    register_peft_targets()
    targets = args.lora_target_modules
    config = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=(targets[0] if targets == ["all-linear"] else targets) or None,
        task_type="CAUSAL_LM",
    )
    with quiet_peft_deprecations():
        model = get_peft_model(model, config)
    trainable, total = model.get_nb_trainable_parameters()
    say(f"LoRA on {sorted(model.peft_config['default'].target_modules)}: {trainable:,} of {total:,} parameters train")
    return model


def set_adapter_base(adapter_folder: str, base: str) -> None:
    import json

    path = os.path.join(adapter_folder, "adapter_config.json")
    with open(path) as f:
        config = json.load(f)
    config["base_model_name_or_path"] = base
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def train_sft(args, cpu: bool = False) -> str:
    """Fine-tune a Deriv language model on conversations as `args` (a `ChatTrainingArguments`) say."""
    if args.lora:
        require_extra("lora", "deriv train sft --lora")  # before the data is read and the model loaded
    return run(args, ChatTask(args), cpu=cpu)
