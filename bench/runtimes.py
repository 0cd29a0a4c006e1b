"""Batch-1 greedy decode in the CPU runtimes Deriv exports to, beside Deriv's own and the memory-bandwidth floor.

One Llama-shaped Deriv decoder at the benchmark shape (`--layers --hidden --heads --context --vocab`; rotary,
RMSNorm, SwiGLU with d_ff = 4 x hidden, `--kv-heads` key/value heads, no biases) with its initial weights and
a byte-level BPE of `--vocab` ids learned from the default corpus, then:
- Deriv: `generate()`, dynamic cache, float32; and `generate(decode_loop="compiled")`, Deriv's decode loop, the
  whole step compiled into one graph (the first, warm-up decode compiles it);
- CTranslate2: `deriv export --to ctranslate2`, float32 and int8 (`Generator.generate_batch`, greedy);
- llama.cpp: `deriv export --to gguf`, f32, f16 and q8_0 (llama-cpp-python's `generate`, greedy), only where
  llama_cpp imports (it compiles from source: `make test-llamacpp` builds it).

Each decodes `--new-tokens` tokens after a `--prompt`-token prompt, streamed; decode tokens/s is (new tokens - 1)
over the time from the first new token (which holds the prefill) to the last, the median of `--repeats` runs.
The floor: one decode step reads every weight once, so it cannot beat bytes of the weights / memory bandwidth
(measured as in `deriv bench inference`); each runtime's floor uses its own bytes (the model file: 4, 2 or
about 1 byte a weight). Every runtime gets `--threads` threads.

Needs the runtimes extra (ctranslate2, gguf).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from ..arguments import integer
from ..errors import UsageError, refused_as_usage, require_extra
from .decoder import add_shape_arguments
from .inference import memory_bandwidth, weight_bytes
from .report import check_json_path, entry_point, markdown_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_arguments(parser)
    parser.add_argument("--kv-heads", type=integer(minimum=1), default=None, help="key/value heads (default: --heads)")
    parser.add_argument("--prompt", type=integer(minimum=1), default=32, help="prompt length")
    parser.add_argument("--new-tokens", type=integer(minimum=2), default=128, help="greedy new tokens per decode")
    parser.add_argument("--repeats", type=integer(minimum=1), default=5, help="timed decodes per runtime")
    parser.add_argument("--threads", type=integer(minimum=1), default=2, help="threads for every runtime")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


def llama_shaped_folder(args, folder: str) -> torch.nn.Module:
    """The Llama-shaped Deriv decoder at the benchmark shape, saved in `folder` with a BPE of `--vocab` ids."""
    from ..data.corpus import default_corpus
    from ..modeling_deriv import DerivConfig, DerivForCausalLM
    from ..tokenization.bpe import save_tokenizer, train_bpe

    with refused_as_usage(f"--hidden {args.hidden} --heads {args.heads} --kv-heads {args.kv_heads or args.heads}"):
        config = llama_shaped_config(args, DerivConfig)  # before the tokenizer is trained: a bad shape fails at once
    tokenizer, _ = train_bpe(default_corpus().documents(), args.vocab, progress=False)
    save_tokenizer(tokenizer, folder)
    torch.manual_seed(0)
    model = DerivForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def llama_shaped_config(args, config_class):
    return config_class(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or args.heads,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=args.context,
        pre_norm=True,
        position_embedding_type="rotary",
        norm_type="rms_norm",
        gated_mlp=True,
        hidden_act="silu",
        scale_embedding=False,
        bias=False,
        dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def decode_rate(decode, prompt: list[int], new_tokens: int, repeats: int) -> float:
    """Decode tokens/s: (new_tokens - 1) over the time from the first new token to the last, the median of
    `repeats` runs. `decode(prompt, n)` returns the time each of the n new tokens arrived, so the prefill (which
    ends with the first) is left out."""
    decode(prompt, 2)  # warm-up
    rates = []
    for _ in range(repeats):
        times = decode(prompt, new_tokens)
        assert len(times) == new_tokens, (len(times), new_tokens)
        rates.append((new_tokens - 1) / (times[-1] - times[0]))
    return statistics.median(rates)


class _Stamps:
    """A streamer for generate() that records when each new token arrives (the first put is the prompt)."""

    def __init__(self):
        self.times, self.prompt_seen = [], False

    def put(self, value) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def deriv_decoder(model, decode_loop: str | None = None):
    def decode(prompt, n):
        stamps = _Stamps()
        with torch.no_grad():
            model.generate(
                torch.tensor([prompt]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
                streamer=stamps,
                decode_loop=decode_loop,
            )
        return stamps.times

    return decode


def ct2_decoder(path: str, threads: int, tokens: list[str]):
    import ctranslate2

    generator = ctranslate2.Generator(path, device="cpu", intra_threads=threads)

    def decode(prompt, n):
        steps = generator.generate_tokens([tokens[i] for i in prompt], max_length=n, min_length=n, end_token=[])
        return [time.perf_counter() for _ in steps]

    return decode


def llama_cpp_decoder(path: str, threads: int, context: int):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=context, n_threads=threads, n_batch=context, verbose=False)

    def decode(prompt, n):
        times = []
        for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            times.append(time.perf_counter())
            if len(times) == n:
                break
        return times

    return decode


def llama_cpp_importable() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def run(args) -> int:
    check_json_path(args.json)
    from ..tokenization.bpe import BYTE_ALPHABET_SIZE, LARGEST_VOCAB_SIZE, SPECIAL_TOKENS

    smallest = BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
    if not smallest <= args.vocab <= LARGEST_VOCAB_SIZE:  # the byte-level BPE the folder carries
        raise UsageError(f"--vocab {args.vocab}: the BPE needs {smallest} to {LARGEST_VOCAB_SIZE} ids")
    if args.prompt + args.new_tokens > args.context:
        raise UsageError(f"--prompt + --new-tokens = {args.prompt + args.new_tokens}: past --context {args.context}")
    if args.hidden_act != "relu" or args.pre_norm:
        raise UsageError(
            "--hidden-act and --pre-norm are the decoder bench's: bench runtimes builds Llama's shape (SiLU, pre-norm)"
        )
    require_extra("runtimes", "deriv bench runtimes")  # after the flags: a bad one is named with or without it
    from ..convert import export_model

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, args.vocab, (args.prompt,), generator=gen).tolist()
    rows = []
    with tempfile.TemporaryDirectory(prefix="deriv-bench-runtimes-") as root:
        folder = os.path.join(root, "deriv")
        model = llama_shaped_folder(args, folder)
        from transformers import AutoTokenizer

        tokens = AutoTokenizer.from_pretrained(folder).convert_ids_to_tokens(list(range(args.vocab)))
        bandwidth = memory_bandwidth()
        runs = [
            ("Deriv generate()", "float32", weight_bytes(model), deriv_decoder(model)),
            ("Deriv decode loop", "float32", weight_bytes(model), deriv_decoder(model, "compiled")),
        ]
        for quantization in ("float32", "int8"):
            out = export_model(
                folder, "ctranslate2", os.path.join(root, f"ct2-{quantization}"), quantization=quantization
            )
            size = os.path.getsize(os.path.join(out, "model.bin"))
            runs.append(("CTranslate2", quantization, size, ct2_decoder(out, args.threads, tokens)))
        if llama_cpp_importable():
            for outtype in ("f32", "f16", "q8_0"):
                out = export_model(folder, "gguf", os.path.join(root, f"m-{outtype}.gguf"), outtype=outtype)
                runs.append(
                    ("llama.cpp", outtype, os.path.getsize(out), llama_cpp_decoder(out, args.threads, args.context))
                )
        else:
            print("llama.cpp: llama_cpp does not import here (make test-llamacpp builds llama-cpp-python); skipped")
        for name, dtype, size, decode in runs:
            rate = decode_rate(decode, prompt, args.new_tokens, args.repeats)
            floor = bandwidth / size
            rows.append([name, dtype, size / 1e6, rate, floor, 100 * rate / floor])
            del decode
    print(
        f"Batch-1 greedy decode, Llama-shaped Deriv at layers {args.layers}, hidden {args.hidden}, heads {args.heads} "
        f"(kv {args.kv_heads or args.heads}), vocab {args.vocab}; prompt {args.prompt}, {args.new_tokens} new tokens, "
        f"{args.threads} threads; memory bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    markdown_table(["runtime", "weights", "MB", "decode tok/s", "floor tok/s", "% of floor"], rows)
    if args.json:
        import json

        keys = ("runtime", "weights", "megabytes", "decode_tokens_per_s", "floor_tokens_per_s", "percent_of_floor")
        with open(args.json, "w") as f:
            json.dump(
                {"bandwidth_bytes_per_s": bandwidth, "rows": [dict(zip(keys, r, strict=True)) for r in rows]},
                f,
                indent=2,
            )
    return 0


main = entry_point(__doc__, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
