"""Deriv's encoder-decoder vs Hugging Face's MarianMTModel at the same size, side by side in one run.

    deriv bench seq2seq                      # or: python -m deriv_lm.bench.seq2seq
    deriv bench seq2seq --train-steps 5 --beam-repeats 3 --json out.json

Marian is the library's model closest to the paper (post-LN, sinusoidal positions, scaled and tied
embeddings); both get the same shape (default: 3 + 3 layers, hidden 384, 6 heads, d_ff 1536, vocab
8192), ReLU, sdpa attention, no dropout, the same threads and the same inputs. Timings interleave
the two models step by step so that machine noise hits both alike; the table gives medians and the
Deriv / Marian ratio. Peak tensor memory comes from the profiler's allocation events.
"""

import argparse
import statistics
import time

import torch

from ..arguments import integer
from ..errors import refused_as_usage
from .decoder import peak_tensor_mib
from .report import check_json_path, entry_point, side_by_side


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=integer(minimum=1), default=3, help="layers per side")
    parser.add_argument("--hidden", type=integer(minimum=1), default=384)
    parser.add_argument("--heads", type=integer(minimum=1), default=6)
    parser.add_argument("--ffn", type=integer(minimum=1), default=1536)
    parser.add_argument("--vocab", type=integer(minimum=1), default=8192)
    parser.add_argument(
        "--batch", type=integer(minimum=1), default=8, help="pairs per training batch and sources per beam search"
    )
    parser.add_argument("--source-len", type=integer(minimum=1), default=128)
    parser.add_argument("--target-len", type=integer(minimum=1), default=128)
    parser.add_argument("--train-steps", type=integer(minimum=1), default=16, help="timed training steps per model")
    parser.add_argument("--beams", type=integer(minimum=1), default=4)
    parser.add_argument("--new-tokens", type=integer(minimum=1), default=64, help="new tokens per beam search")
    parser.add_argument("--beam-repeats", type=integer(minimum=1), default=5, help="timed beam searches per model")
    parser.add_argument(
        "--threads", type=integer(minimum=1), default=None, help="torch threads (default: torch's choice)"
    )
    parser.add_argument(
        "--same-weights",
        action="store_true",
        help="Deriv is the Marian model imported (`deriv import`): Marian's very weights, its output bias too",
    )
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


def build(kind: str, args) -> torch.nn.Module:
    """One model of `kind` ('deriv' or 'marian') at the benchmark's shape, in train mode, sdpa, no dropout."""
    torch.manual_seed(0)
    positions = max(args.source_len, args.target_len, args.new_tokens + 1)
    shape = dict(
        vocab_size=args.vocab,
        encoder_layers=args.layers,
        decoder_layers=args.layers,
        encoder_attention_heads=args.heads,
        decoder_attention_heads=args.heads,
        max_position_embeddings=positions,
        dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    if kind == "deriv" and getattr(args, "same_weights", False):
        from ..convert.folders import marian_twin

        model = marian_twin(build("marian", args))  # Marian built from the same seed, then imported
    elif kind == "deriv":
        from ..modeling_deriv import DerivForConditionalGeneration, DerivSeq2SeqConfig

        with refused_as_usage(f"--hidden {args.hidden} --heads {args.heads} --ffn {args.ffn}"):
            config = DerivSeq2SeqConfig(
                **shape, hidden_size=args.hidden, intermediate_size=args.ffn, hidden_act="relu"
            )
        model = DerivForConditionalGeneration(config)
    else:
        from transformers import MarianConfig, MarianMTModel

        with refused_as_usage(f"--hidden {args.hidden} --heads {args.heads} --ffn {args.ffn}"):
            config = MarianConfig(
                **shape,
                d_model=args.hidden,
                encoder_ffn_dim=args.ffn,
                decoder_ffn_dim=args.ffn,
                activation_function="relu",
                activation_dropout=0.0,
                scale_embedding=True,
            )
        model = MarianMTModel(config)
    model.set_attn_implementation("sdpa")
    return model


def train_step(model, optimizer, batch) -> None:
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def beam_search(model, sources, args) -> torch.Tensor:
    return model.generate(
        **sources,
        num_beams=args.beams,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,  # both models search exactly the same number of steps
        early_stopping=True,
        do_sample=False,
    )


def _timed(fn, kinds, repeats) -> dict[str, float]:
    """Median seconds of fn(kind) per kind, alternating who goes first."""
    times = {k: [] for k in kinds}
    for i in range(repeats):
        for k in kinds if i % 2 == 0 else kinds[::-1]:
            start = time.perf_counter()
            fn(k)
            times[k].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def run(args) -> int:
    check_json_path(args.json)
    if args.threads:
        torch.set_num_threads(args.threads)
    kinds = ("deriv", "marian")
    models = {k: build(k, args) for k in kinds}
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    g = torch.Generator().manual_seed(0)
    source = torch.randint(3, args.vocab, (args.batch, args.source_len), generator=g)
    labels = torch.randint(3, args.vocab, (args.batch, args.target_len), generator=g)
    batch = {"input_ids": source, "attention_mask": torch.ones_like(source), "labels": labels}
    rows = []  # (metric, deriv, marian, unit)

    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    for k in kinds:  # warm-up: the first steps allocate the optimizer state
        for _ in range(2):
            train_step(models[k], optimizers[k], batch)
    seconds = _timed(lambda k: train_step(models[k], optimizers[k], batch), kinds, args.train_steps)
    tokens = args.batch * (args.source_len + args.target_len)
    rows.append(("train tokens/s (source + target, AdamW)", *(tokens / seconds[k] for k in kinds), "tok/s"))
    peaks = {k: peak_tensor_mib(lambda k=k: train_step(models[k], optimizers[k], batch)) for k in kinds}
    rows.append(("peak tensor memory, train step", *(peaks[k] for k in kinds), "MiB"))
    optimizers.clear()  # free the optimizer state before decoding

    for m in models.values():
        m.eval()
    sources = {"input_ids": source, "attention_mask": torch.ones_like(source)}
    short = argparse.Namespace(**{**vars(args), "new_tokens": 4})
    for k in kinds:
        beam_search(models[k], sources, short)  # warm-up
    seconds = _timed(lambda k: beam_search(models[k], sources, args), kinds, args.beam_repeats)
    tokens = args.batch * args.new_tokens
    label = f"beam search new tokens/s ({args.beams} beams)"
    rows.append((label, *(tokens / seconds[k] for k in kinds), "tok/s"))
    peaks = {k: peak_tensor_mib(lambda k=k: beam_search(models[k], sources, args)) for k in kinds}
    rows.append(("peak tensor memory, beam search", *(peaks[k] for k in kinds), "MiB"))

    title = (
        f"Deriv vs MarianMTModel: {args.layers}+{args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
        f"d_ff {args.ffn}, vocab {args.vocab}; batch {args.batch}, {args.source_len}+{args.target_len} tokens, "
        f"{args.new_tokens} new tokens; "
        + ("Deriv = Marian imported, the same weights; " if getattr(args, "same_weights", False) else "")
        + f"threads={torch.get_num_threads()}, torch {torch.__version__}"
    )
    notes = [f"parameters: Deriv {params['deriv']:,}, Marian {params['marian']:,}"]
    side_by_side(title, notes, rows, "Marian", "marian", args.json)
    return 0


main = entry_point(__doc__, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
