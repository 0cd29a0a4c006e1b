"""The causal language-modelling task.

tokenizer -> packed blocks -> Deriv decoder -> trainer core -> exported folder.
"""

from __future__ import annotations

import os
import time

import torch

from deriv_lm.modeling_deriv import DerivConfig, DerivForCausalLM
from deriv_lm.tokenization.bpe import save_tokenizer, special_tokens_with, train_bpe
from deriv_lm.tokenization.commands import characters_per_token, corpus_from_args

from .data import lm_datasets
from .export import export_folder, run_record
from .runlock import releases_run_lock
from .trainer import Task, Trainer


SAMPLE_PROMPTS = ["Return the", "The default", "This module"]


def collate(examples: list[dict]) -> dict:
    input_ids = torch.stack([e["input_ids"] for e in examples])  # packed blocks: all the same length
    return {"input_ids": input_ids, "labels": input_ids}


def count_targets(batch: dict) -> torch.Tensor:
    """Tokens the loss is taken over: every position but the first of each block (it has no predecessor)."""
    return (batch["labels"][:, 1:] != -100).sum()


def load_or_train_tokenizer(args, corpus, accelerator):
    """An existing tokenizer (--tokenizer, or the one an earlier run of this output_dir trained), or a new one."""
    from transformers import AutoTokenizer

    folder = args.tokenizer or os.path.join(args.output_dir, "tokenizer")
    with accelerator.main_process_first():  # one process trains and saves; the others then load
        if not os.path.exists(os.path.join(folder, "tokenizer.json")):
            if args.tokenizer:
                raise FileNotFoundError(f"No tokenizer.json in {args.tokenizer}")
            tokenizer, summary = train_bpe(
                corpus, args.vocab_size, special_tokens_with(), progress=args.progress and accelerator.is_main_process
            )
            save_tokenizer(tokenizer, folder, model_max_length=args.context_length)
            accelerator.print(
                f"tokenizer: {summary.vocab_size} ids from {summary.characters / 1e6:.2f} M characters "
                f"in {summary.seconds:.2f} s -> {folder}"
            )
        tokenizer = AutoTokenizer.from_pretrained(folder)
    if len(tokenizer) != args.vocab_size:
        # The model's vocabulary is the tokenizer's; record the size that was used, not the one asked for.
        accelerator.print(
            f"note: the tokenizer in {folder} has {len(tokenizer)} ids, not --vocab-size {args.vocab_size}; "
            f"the model uses {len(tokenizer)}"
        )
        args.vocab_size = len(tokenizer)
    return tokenizer


def build_model(args, tokenizer) -> DerivForCausalLM:
    config = DerivConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.context_length,
        hidden_act=args.hidden_act,
        pre_norm=args.pre_norm,
        dropout=args.dropout,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return DerivForCausalLM(config)


def generation_defaults(tokenizer, context_length: int):
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=True,
        temperature=0.8,
        top_k=50,
        top_p=0.95,
        repetition_penalty=1.1,
        max_new_tokens=min(100, context_length // 2),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


@releases_run_lock
def train_lm(args, cpu: bool = False) -> str:
    """Train a Deriv language model as `args` say; returns the exported folder."""
    started = time.perf_counter()
    trainer = Trainer(args, cpu=cpu)
    accelerator = trainer.accelerator
    corpus = corpus_from_args(args)
    tokenizer = load_or_train_tokenizer(args, corpus, accelerator)
    with accelerator.main_process_first():
        train_ds, val_ds = lm_datasets(corpus, tokenizer, args)
    model = build_model(args, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    accelerator.print(
        f"model: {n_params / 1e6:.2f} M parameters; data: {len(train_ds)} training and {len(val_ds)} validation "
        f"blocks of {args.context_length} tokens; {accelerator.num_processes} process(es) on {accelerator.device}"
    )
    state = trainer.train(Task(model, train_ds, val_ds, collate, count_targets))

    accelerator.wait_for_everyone()
    # A collective: under FSDP or DeepSpeed ZeRO-3 the full weights are gathered from every process.
    state_dict = accelerator.get_state_dict(trainer.model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(trainer.model)
        unwrapped.generation_config = generation_defaults(tokenizer, args.context_length)
        ratio = characters_per_token(tokenizer, [t for _, t in zip(range(300), corpus, strict=False)])
        final = next((r for r in reversed(state.history) if "val_loss" in r), {})
        record = run_record(
            "causal-lm",
            args,
            {
                "corpus": corpus.description,
                "train_blocks": len(train_ds),
                "validation_blocks": len(val_ds),
                "context_length": args.context_length,
            },
            tokenizer,
            ratio,
            unwrapped,
            state,
            accelerator,
            time.perf_counter() - started,
            {"val_loss": final.get("val_loss"), "val_perplexity": final.get("val_perplexity")},
        )
        export_folder(args.output_dir, unwrapped, state_dict, tokenizer, record, state.history, accelerator.print)
        show_samples(unwrapped, tokenizer, args)
        seconds, metrics = record["training"]["wall_seconds"], record["metrics"]
        accelerator.print(
            f"done: {state.step} steps, {state.tokens_seen / 1e6:.2f} M tokens in {seconds:.0f} s; "
            f"validation perplexity {metrics['val_perplexity']:.2f}; model folder: {os.path.abspath(args.output_dir)}"
        )
    accelerator.wait_for_everyone()
    return args.output_dir


@torch.no_grad()
def show_samples(model, tokenizer, args) -> None:
    model.eval()
    torch.manual_seed(args.seed)
    for prompt in SAMPLE_PROMPTS[: args.samples]:
        inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
        out = model.generate(**inputs, max_new_tokens=min(40, args.context_length // 2))
        print(f"--- sample: {tokenizer.decode(out[0], skip_special_tokens=True)!r}")
