"""The causal language-modelling task.

tokenizer -> packed blocks -> Deriv decoder -> trainer core -> exported folder.
"""

from __future__ import annotations

import json
import os
import platform
import time

import torch

from deriv_lm.modeling_deriv import DerivConfig, DerivForCausalLM
from deriv_lm.tokenization.bpe import save_tokenizer, special_tokens_with, train_bpe
from deriv_lm.tokenization.commands import characters_per_token, corpus_from_args
from deriv_lm.tokenization.files import atomic_directory

from .data import lm_datasets
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
        return AutoTokenizer.from_pretrained(folder)


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


def plot_losses(history: list[dict], path: str) -> bool:
    """Training and validation loss against tokens seen, as a PNG; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    train = [(r["tokens_seen"], r["train_loss"]) for r in history if "train_loss" in r]
    val = [(r["tokens_seen"], r["val_loss"]) for r in history if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(*zip(*train, strict=True), label="training loss", linewidth=1)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation loss")
    ax.set_xlabel("tokens seen")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def run_record(args, corpus, blocks, tokenizer, model, state, chars_per_token, accelerator, seconds) -> dict:
    import accelerate
    import datasets
    import tokenizers
    import transformers

    final = next((r for r in reversed(state.history) if "val_loss" in r), {})
    return {
        "task": "causal-lm",
        "arguments": {k: v for k, v in vars(args).items()},
        "data": {
            "corpus": corpus.description,
            "train_blocks": blocks[0],
            "validation_blocks": blocks[1],
            "context_length": args.context_length,
        },
        "tokenizer": {
            "vocab_size": len(tokenizer),
            "characters_per_token": chars_per_token,
            "special_tokens": tokenizer.all_special_tokens,
        },
        "model": {"parameters": sum(p.numel() for p in model.parameters()), "config": model.config.to_diff_dict()},
        "training": {
            "steps": state.step,
            "tokens_seen": state.tokens_seen,
            "train_seconds": state.train_seconds,
            "wall_seconds": seconds,
        },
        "hardware": {
            "device": str(accelerator.device),
            "processes": accelerator.num_processes,
            "mixed_precision": accelerator.mixed_precision,
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "accelerate": accelerate.__version__,
            "datasets": datasets.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "metrics": {"val_loss": final.get("val_loss"), "val_perplexity": final.get("val_perplexity")},
    }


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
        blocks = (len(train_ds), len(val_ds))
        seconds = time.perf_counter() - started
        record = run_record(args, corpus, blocks, tokenizer, unwrapped, state, ratio, accelerator, seconds)
        with atomic_directory(args.output_dir) as tmp:  # the model files appear together or not at all
            unwrapped.save_pretrained(tmp, state_dict=state_dict)
            tokenizer.save_pretrained(tmp)
            from deriv_lm.tokenization.bpe import make_portable

            make_portable(tmp)
            with open(os.path.join(tmp, "run.json"), "w") as f:
                json.dump(record, f, indent=2, default=str)
            if not plot_losses(state.history, os.path.join(tmp, "loss.png")):
                accelerator.print("loss.png skipped: pip install matplotlib (or deriv-lm[viz]) to plot the curves")
        show_samples(unwrapped, tokenizer, args)
        metrics = record["metrics"]
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
