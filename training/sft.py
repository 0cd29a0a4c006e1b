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
import os
import random
import shutil
import tempfile

import torch
from accelerate import PartialState

from ..data.conversations import default_conversations, hub_conversations, local_conversations
from ..data.packing import LengthGroupedSampler
from ..modeling_deriv import DerivForCausalLM
from ..tokenization.bpe import CHAT_TEMPLATE, ROLE_TOKENS, chat_template_with_generation_marks
from .driver import run
from .lm import LanguageModelTask
from .task import Task


def conversations_from_args(args):
    """The conversations `args` name: --files (.jsonl), --dataset, or the embedded synthetic default."""
    if args.files:
        return local_conversations(args.files, args.messages_column)
    if args.dataset:
        return hub_conversations(args.dataset, args.dataset_config, args.split, args.messages_column)
    return default_conversations()


def prepare_chat_tokenizer(tokenizer) -> list[str]:
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
        raise ValueError(
            "The tokenizer's chat template does not mark the assistant's messages ({% generation %} ... "
            "{% endgeneration %}), so the loss cannot be limited to them; add the marks to chat_template.jinja."
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return added


def encode_conversations(rows, tokenizer, context_length: int):
    """(dataset of `input_ids`, `labels`, `length`; conversations dropped as longer than `context_length`).

    Longer conversations are dropped, not cut: a cut reply would teach the model to stop mid-sentence."""
    import datasets

    def encode(row):
        out = tokenizer.apply_chat_template(
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
        prompt = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, return_tensors="pt")
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
    unit = "conversations"
    token_kind = "assistant tokens"
    model_class = DerivForCausalLM
    build_model = LanguageModelTask.build_model  # a new model from the flags (only without --init-from)
    generation_config = LanguageModelTask.generation_config

    def load(self) -> None:
        a = self.args
        self.conversations = conversations_from_args(a)
        rows = list(self.conversations.rows[: a.max_conversations])
        random.Random(a.seed).shuffle(rows)
        held_out = max(1, round(len(rows) * a.validation_fraction))
        if len(rows) - held_out < 1:
            raise ValueError(f"{self.conversations.description} gives {len(rows)} conversation(s); at least 2 needed")
        self.splits = {"validation": rows[:held_out], "train": rows[held_out:]}

    def tokenizer_texts(self):
        return (m["content"] for row in self.splits["train"] for m in row)

    def datasets(self, tokenizer) -> tuple:
        a = self.args
        self.added_tokens = prepare_chat_tokenizer(tokenizer)
        self.train, too_long_train = encode_conversations(self.splits["train"], tokenizer, a.max_position_embeddings)
        self.validation, too_long_val = encode_conversations(
            self.splits["validation"], tokenizer, a.max_position_embeddings
        )
        self.too_long = too_long_train + too_long_val
        if len(self.train) == 0 or len(self.validation) == 0:
            raise ValueError(
                f"No {'training' if len(self.train) == 0 else 'validation'} conversation fits --context-length "
                f"{a.max_position_embeddings}; pass a longer --context-length or shorter conversations."
            )
        self.train_lengths = list(self.train["length"])
        by_length = sorted(range(len(self.validation)), key=list(self.validation["length"]).__getitem__)
        self.train = self.train.remove_columns("length")
        self.validation = self.validation.select(by_length).remove_columns("length")
        self.say(
            f"data: {self.conversations.description}: {len(self.train)} / {len(self.validation)} train / validation "
            f"conversations; {self.too_long} dropped as longer than {a.max_position_embeddings} tokens"
        )
        return self.train, self.validation

    def match_vocabulary(self, model, tokenizer):
        """Role tokens the tokenizer just gained get new embedding rows, the mean of the others (transformers'
        `mean_resizing`), so that their first logits are ordinary; the tied output projection grows with them."""
        if len(tokenizer) > model.config.vocab_size:
            self.say(f"adding embedding rows for {', '.join(self.added_tokens)} (the mean of the existing rows)")
            model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
        return model

    def adopt(self, model, tokenizer):
        self.collator = chat_collator(tokenizer, self.args.packing)
        self.base_val_loss = assistant_loss(model, self.validation, self.collator, self.args.batch_size)
        self.say(f"before fine-tuning: validation loss {self.base_val_loss:.4f} per assistant token")
        self.shown = prompts_that_fit(self.splits["validation"], tokenizer, self.args, self._reply_tokens())
        self.before = replies(model, tokenizer, self.shown, self._reply_tokens())
        self.tokenizer = tokenizer
        if self.args.lora:
            check_lora_mode(PartialState().distributed_type)
            model = with_lora(model, self.args, self.say)
            self.lora_targets = sorted(model.peft_config["default"].target_modules)
        return model

    def _reply_tokens(self) -> int:
        return min(64, self.args.max_position_embeddings // 2)

    def sampler(self, dataset, seed: int):
        return None if self.args.packing else LengthGroupedSampler(self.train_lengths, self.args.batch_size, seed)

    def exported_model(self, model, state_dict):
        """The model the folder holds: after the sample replies, LoRA's adapters merged in (or set aside)."""
        self.after = replies(model, self.tokenizer, self.shown, self._reply_tokens())
        if not self.args.lora:
            return model, state_dict
        if self.args.lora_export == "merged":
            return model.merge_and_unload(), None
        self.adapter_dir = tempfile.mkdtemp(prefix="deriv-adapter-")
        model.save_pretrained(self.adapter_dir)  # adapter_config.json + adapter_model.safetensors
        return model.unload(), None  # the base weights, without the adapters

    def write_extras(self, folder: str) -> None:
        """--lora-export adapter: the adapter in FOLDER/adapter, naming its base by the folder's name (a Hub id
        once published), never the local path it was trained from."""
        if getattr(self, "adapter_dir", None):
            target = os.path.join(folder, "adapter")
            shutil.copytree(self.adapter_dir, target)
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
            set_adapter_base(target, os.path.basename(os.path.abspath(self.args.output_dir)))

    def final_metrics(self, model, tokenizer) -> dict:
        examples = [
            {"messages": list(shown), "before": b, "after": a}
            for shown, b, a in zip(self.shown, self.before, self.after, strict=True)
        ]
        return {"base_val_loss": self.base_val_loss, "conversations": examples}

    def record_data(self) -> dict:
        a = self.args
        return dict(
            corpus=self.conversations.description,
            dataset=a.dataset if a.dataset else None,
            unit=self.unit,
            train=len(self.train),
            validation=len(self.validation),
            test=None,
            context_length=a.max_position_embeddings,
            dropped_too_long=self.too_long,
            synthetic=self.conversations.synthetic,
        )

    def record_procedure(self) -> dict:
        a = self.args
        if not a.lora:
            return {}
        lora = dict(r=a.lora_r, alpha=a.lora_alpha, dropout=a.lora_dropout, export=a.lora_export)
        return {"lora": {**lora, "targets": getattr(self, "lora_targets", a.lora_target_modules)}}

    def sample_texts(self) -> list[str]:
        return [m["content"] for row in self.splits["train"][:300] for m in row]

    def show_samples(self, model, tokenizer, say) -> None:
        for shown, before, after in zip(self.shown, self.before, self.after, strict=True):
            say(f"--- user: {shown[-1]['content']!r}\n    before: {before!r}\n    after:  {after!r}")


def prompts_that_fit(rows, tokenizer, args, reply_tokens: int) -> list[tuple[dict, ...]]:
    """The first `args.samples` validation conversations cut before their last assistant message whose prompt
    leaves room for a reply of `reply_tokens` in the context: what the run shows before and after training."""
    shown = []
    for row in rows:
        if len(shown) == args.samples:
            break
        prompt = row[: max(i for i, m in enumerate(row) if m["role"] == "assistant")]
        ids = tokenizer.apply_chat_template(
            list(prompt), add_generation_prompt=True, tokenizer_kwargs={"verbose": False}
        )
        if len(ids["input_ids"]) + reply_tokens <= args.max_position_embeddings:
            shown.append(prompt)
    return shown


def check_lora_mode(mode) -> None:
    """LoRA runs on one process or under DDP. Under FSDP and DeepSpeed the exported weights are gathered into a
    plain model, which the adapters' names do not fit; refused before any step is spent."""
    from accelerate.utils import DistributedType

    if mode in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise ValueError(
            f"--lora runs on one process or under DDP, not under {mode.value}; launch without FSDP / DeepSpeed "
            "(LoRA's memory saving is in the optimizer state already), or fine-tune every weight"
        )


def with_lora(model, args, say=print):
    """`model` with LoRA adapters (PEFT), only they trainable; the targets default to PEFT's lookup for Deriv."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as error:
        raise ValueError("--lora needs PEFT: pip install 'deriv-lm[lora]' (or pip install peft)") from error
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
    return run(args, ChatTask(args), cpu=cpu)
