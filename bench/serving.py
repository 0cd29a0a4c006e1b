"""Serving many requests at once: continuous batching against padded batches, in-process and over HTTP.

    deriv bench serving                  # or: python -m deriv_lm.bench.serving
    deriv bench serving --no-server      # generate_batch against generate() only (no serve extra needed)

One Deriv model at the decoder bench's shape (default: 6 layers, hidden 384, vocab 8192, context 256; random
weights, greedy decoding):

1. `generate_batch` (continuous batching: every prompt's tokens packed into one row, a paged KV cache, a
   sequence leaves the batch the step it ends) against one padded `generate()` over the same prompts of mixed
   lengths (left-padded to the longest; every row decodes until the last one ends). Both make exactly
   --new-tokens tokens per prompt; the table gives new tokens/s (medians of --repeats, the two interleaved) and
   how many prompts got the very same tokens from both.
2. `deriv serve` in a child process, with and without `--continuous-batching`, and --clients concurrent clients
   each sending --requests completions one after another: requests/s, new tokens/s and the median latency.
   Without continuous batching the server decodes one request at a time (one `generate()` on one worker thread).
3. vLLM on the same folder, prompts and clients, where vllm imports (`make test-vllm` builds `.venv-vllm`; else the
   row says so; `--no-vllm` skips it): `python -m vllm.entrypoints.openai.api_server` with the flags that serve a
   Deriv folder exactly (docs/serving.md, "Past one machine"), one request at a time (`--max-num-seqs 1`) and with
   its continuous batching.

--device (auto: cuda where there is one) and --dtype (auto: bfloat16 on cuda, float32 on the CPU) set where and
in what the model decodes, in this process and in the server (`deriv serve --device --dtype`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import tempfile
import time

import torch

from ..arguments import integer
from . import device as dev
from .decoder import add_shape_arguments, build
from .report import check_json_path, entry_point


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_shape_arguments(parser)
    parser.add_argument("--prompts", type=integer(minimum=1), default=32, help="prompts for generate_batch")
    parser.add_argument("--new-tokens", type=integer(minimum=1), default=64, help="new tokens per prompt")
    parser.add_argument("--repeats", type=integer(minimum=1), default=3, help="timed runs of each (median)")
    parser.add_argument("--clients", type=integer(minimum=1), default=16, help="concurrent clients of the server")
    parser.add_argument("--requests", type=integer(minimum=1), default=2, help="completions per client")
    parser.add_argument("--no-server", action="store_true", help="skip the HTTP part")
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM in the HTTP part")
    parser.add_argument("--threads", type=integer(minimum=1), default=None, help="torch threads")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    dev.add_device_arguments(parser, dtype="the weights' dtype, here and in the server")
    parser.set_defaults(same_weights=False)  # `build` asks; this bench builds Deriv alone


def mixed_prompts(args, count: int) -> list[list[int]]:
    """`count` prompts of random ids, lengths spread evenly from 4 to what leaves room for --new-tokens."""
    longest = max(4, min(args.context - args.new_tokens, args.context // 2))
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, longest + 1, (count,), generator=generator).tolist()
    return [torch.randint(3, args.vocab, (n,), generator=generator).tolist() for n in lengths]


def batching_config(args, prompts: list[list[int]]):
    """A paged cache that holds every sequence whole (transformers sizes it from free memory otherwise: most of
    the RAM on the CPU)."""
    from transformers import ContinuousBatchingConfig

    positions = sum(len(p) + args.new_tokens for p in prompts)
    return ContinuousBatchingConfig(num_blocks=-(-positions // 256) + 1, max_batch_tokens=2048)


@torch.no_grad()
def padded_generate(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=model.device)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding: every row's last token is at the end
        ids[row, width - len(prompt) :] = torch.tensor(prompt, device=model.device)
        mask[row, width - len(prompt) :] = 1
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
        pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    return out[:, width:].tolist()


@torch.no_grad()
def batch_generate(model, prompts: list[list[int]], new_tokens: int, config) -> list[list[int]]:
    from transformers import GenerationConfig

    greedy = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=-1)
    results = model.generate_batch(
        inputs=prompts, generation_config=greedy, continuous_batching_config=config, progress_bar=False
    )
    ordered = sorted(results.values(), key=lambda result: int(result.request_id.rsplit("_", 1)[-1]))
    return [result.generated_tokens for result in ordered]


def measure_batching(args, model) -> list[tuple]:
    prompts = mixed_prompts(args, args.prompts)
    config = batching_config(args, prompts)
    runs = {
        "padded generate()": lambda: padded_generate(model, prompts, args.new_tokens),
        "generate_batch": lambda: batch_generate(model, prompts, args.new_tokens, config),
    }
    outputs = {name: run() for name, run in runs.items()}  # warm-up, and the tokens to compare
    device = model.device.type
    times = {name: [] for name in runs}
    for repeat in range(args.repeats):
        for name in runs if repeat % 2 == 0 else list(runs)[::-1]:
            start = dev.clock(device)
            runs[name]()
            times[name].append(dev.clock(device) - start)
    same = sum(a == b for a, b in zip(*outputs.values(), strict=True))
    new = len(prompts) * args.new_tokens
    lengths = sorted(len(p) for p in prompts)
    note = f"{len(prompts)} prompts of {lengths[0]} to {lengths[-1]} tokens, {args.new_tokens} new tokens each"
    return [(name, new / statistics.median(times[name]), f"{same}/{len(prompts)} same tokens", note) for name in runs]


def served_folder(args, model, folder: str) -> str:
    """The bench model as a folder `deriv serve` loads: its weights, a BPE tokenizer of --vocab ids trained on the
    default corpus, and greedy generation defaults."""
    from transformers import GenerationConfig

    from ..data import default_corpus
    from ..tokenization import save_tokenizer, train_bpe

    documents = [doc for _, doc in zip(range(2000), default_corpus(), strict=False)]
    tokenizer, _ = train_bpe(documents, vocab_size=args.vocab, progress=False)
    save_tokenizer(tokenizer, folder, model_max_length=args.context)
    model.save_pretrained(folder)
    GenerationConfig(do_sample=False, bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(folder)
    return folder


def measure_server(args, folder: str, flags: tuple[str, ...], texts: list[str]) -> tuple[float, float, float]:
    """(requests/s, new tokens/s, median latency in s) of --clients clients against `deriv serve FOLDER *flags`."""
    from ..serving.client import ServerProcess

    return measure_clients(args, ServerProcess(folder, *flags, log=os.path.join(folder, "serve.log")), texts, {})


def vllm_server(folder: str, flags: tuple[str, ...], dtype: str):
    """vLLM's OpenAI server on FOLDER in a child process, on a free loopback port, waited for until `/health`
    answers: the module entry point (the CPU build's `vllm` command asks for a distribution it is not named), the
    folder's own code through vLLM's Transformers backend, greedy as the request says (the folder's generation
    config set aside)."""
    import socket
    import subprocess
    import sys

    from ..serving.client import ServerProcess

    class VllmServer(ServerProcess):
        def __init__(self):
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                self.port = probe.getsockname()[1]
            self.url, self.command = f"http://127.0.0.1:{self.port}", "vllm"
            self.folder, self.log = folder, os.path.join(folder, "vllm.log")
            argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--dtype", dtype]
            argv += ["--trust-remote-code", "--model-impl", "transformers", "--generation-config", "vllm"]
            argv += ["--host", "127.0.0.1", "--port", str(self.port), *flags]
            # a KV cache of 1 GiB on the CPU (the default takes a share of the RAM), nothing sent home
            env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", **os.environ}
            with open(self.log, "wb") as out:
                self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
            self._wait_until_healthy(600)  # a compile warm-up, minutes on 2 CPU cores

    return VllmServer()


def measure_vllm(args, folder: str, texts: list[str]) -> dict:
    """{name: (requests/s, new tokens/s, median latency s)} of vLLM one request at a time and batching, or
    {name: reason} where vllm does not import."""
    import importlib.util

    names = {"vllm (one request at a time)": ("--max-num-seqs", "1"), "vllm (continuous batching)": ()}
    if importlib.util.find_spec("vllm") is None:
        return {name: "not measured: vllm is not installed here (make test-vllm builds .venv-vllm)" for name in names}
    dtype = dev.dtype_name(dev.of(args)[1])
    return {
        name: measure_clients(args, vllm_server(folder, flags, dtype), texts, {"model": folder})
        for name, flags in names.items()
    }


def measure_clients(args, server, texts: list[str], body: dict) -> tuple[float, float, float]:
    """(requests/s, new tokens/s, median latency in s) of --clients clients each sending --requests greedy
    completions to a started `server` (ServerProcess's client), stopped after."""
    try:

        def client(index: int) -> list[tuple[float, int]]:
            done = []
            for request in range(args.requests):
                text = texts[(index * args.requests + request) % len(texts)]
                start = time.perf_counter()
                reply = server.post(
                    "/v1/completions", {"prompt": text, "max_tokens": args.new_tokens, "temperature": 0, **body}
                )
                done.append((time.perf_counter() - start, reply["usage"]["completion_tokens"]))
            return done

        client(0)  # warm-up: the first request builds the cache (and the batching manager)
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            replies = [r for done in pool.map(client, range(args.clients)) for r in done]
        wall = time.perf_counter() - start
    finally:
        server.stop()
    tokens = sum(count for _, count in replies)
    return len(replies) / wall, tokens / wall, statistics.median(latency for latency, _ in replies)


def print_table(headers: tuple[str, ...], rows: list[tuple]) -> None:
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join("---:" if i else "---" for i in range(len(headers))) + "|")
    for row in rows:
        print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in row) + " |")


def bench_model(args):
    """Deriv at the bench's shape, eval mode, on its --device in its --dtype."""
    device, dtype = dev.of(args)
    return build("deriv", args).eval().to(device=device, dtype=dtype)


def measure_servers(args, model, flags=((), ("--continuous-batching",)), vllm: bool = False) -> dict:
    """{name: (requests/s, new tokens/s, median latency s)} of `deriv serve` with each of `flags`, on the bench's
    device and dtype, serving the bench's model; with `vllm`, vLLM's rows after them (measure_vllm)."""
    device, dtype = dev.of(args)
    on = ("--device", device, "--dtype", dev.dtype_name(dtype))
    with tempfile.TemporaryDirectory() as folder:
        served_folder(args, model, folder)
        texts = served_prompts(args, folder)
        served = {
            " ".join(("deriv serve", *extra)): measure_server(args, folder, (*extra, *on), texts) for extra in flags
        }
        return {**served, **(measure_vllm(args, folder, texts) if vllm else {})}


def run(args) -> int:
    check_json_path(args.json)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = bench_model(args)
    print(
        f"Deriv, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, context {args.context}; "
        f"{dev.device_name(model.device.type)}, {dev.dtype_name(model.dtype)}; threads={torch.get_num_threads()}, "
        f"torch {torch.__version__}\n"
    )
    batching = measure_batching(args, model)
    print(f"Continuous batching in-process: {batching[0][3]}, medians of {args.repeats}")
    base = batching[0][1]
    print_table(("path", "new tokens/s", "ratio", "agreement"), [(n, t, t / base, s) for n, t, s, _ in batching])
    results = {"batching": [dict(path=n, tokens_per_s=t, agreement=s) for n, t, s, _ in batching]}

    if not args.no_server:
        served = measure_servers(args, model, vllm=not args.no_vllm)
        print(
            f"\nServing: {args.clients} concurrent clients x {args.requests} completions, {args.new_tokens} new "
            f"tokens each (greedy), prompts of 8 to {longest_prompt(args)} tokens"
        )
        base = served["deriv serve"][0]
        rows = [
            (name, *((m[0], m[0] / base, m[1], m[2]) if isinstance(m, tuple) else (m, "", "", "")))
            for name, m in served.items()
        ]
        print_table(("server", "requests/s", "ratio", "new tokens/s", "median latency s"), rows)
        results["serving"] = [
            dict(server=n, requests_per_s=r, tokens_per_s=t, latency_s=lat) for n, r, _, t, lat in rows if t != ""
        ]
        results["not_measured"] = [dict(server=n, note=r) for n, r, _, t, _ in rows if t == ""]
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def longest_prompt(args) -> int:
    return max(8, min(args.context // 2, args.context - args.new_tokens - 4))


def served_prompts(args, folder: str, count: int = 64) -> list[str]:
    """Texts from the default corpus cut to prompts of mixed lengths, 8 tokens up to what leaves room for
    --new-tokens in the context (a longer one is refused: the position table ends there)."""
    from transformers import AutoTokenizer

    from ..data import default_corpus

    tokenizer = AutoTokenizer.from_pretrained(folder)
    longest = longest_prompt(args)
    texts = []
    for i, doc in zip(range(count), default_corpus(), strict=False):
        ids = tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"]
        texts.append(tokenizer.decode(ids[: 8 + (i * 7) % (longest - 7)]))
    return texts


main = entry_point(__doc__, add_arguments, run)


if __name__ == "__main__":
    raise SystemExit(main())
