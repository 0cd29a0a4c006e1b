"""`deriv serve FOLDER`: a Deriv language model behind an OpenAI-compatible HTTP server.

    pip install 'deriv-lm[serve]'
    deriv serve runs/deriv-tiny                          # http://127.0.0.1:8000/v1
    deriv serve runs/deriv-tiny --continuous-batching    # many requests decoded in one packed batch

The endpoints, the request checks and the limits are in `serving/app.py` and `serving/protocol.py`; decoding is
transformers' own (`generate()`, or its continuous batching over a paged KV cache: `serving/engines.py`). This
file is the command, the CLI's face of `serving/`: it checks everything it can before the server listens (the
extra, the device, the address, the folder), so a mistake is one line and exit status 2, then serves until Ctrl-C
or SIGTERM. What `deriv explore` shares with it (the flags, the device, the socket, uvicorn) is `serving/server.py`;
nothing imports this file but the CLI.

The contract (docs/serving.md): one model, the folder the server was started with, loaded from safetensors
with Deriv's installed classes (no remote code, no pickle, a LoRA adapter merged); nothing loads or unloads it
over HTTP; loopback only unless `--host` says otherwise.

subtle: this server is Deriv's, not `transformers serve`. That server loads any model a request names
(`POST /load_model`), lets any client unload it (`/reset`), and one request past the context kills its batching
worker for good; it is also written for the library's own classes. What it does well, the decoding, is what
this server keeps.
"""

from __future__ import annotations

import argparse
import os

from .arguments import BODY_SECONDS, integer, invalid_text, model_folder, number
from .errors import MissingFile, UsageError
from .inference.sampling import add_decode_loop_argument
from .serving import server
from .serving.server import MAX_BODY_BYTES, add_server_arguments, require_serve_extra


# transformers sizes the paged cache of continuous batching from the memory left on the device: on a GPU that is
# what a server wants, on the CPU it is most of the machine's RAM (14 GB for a model of 0.4 MB, measured on a
# 23 GB machine). On the CPU, the cache is sized for this many sequences at full context instead.
CPU_SEQUENCES = 32
CPU_BATCH_TOKENS = 2048
PAGE_SIZE = 256  # ContinuousBatchingConfig.page_size's default: positions per block


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`deriv serve FOLDER [--host --port --continuous-batching --device --dtype ...]`."""
    parser.description = (
        "Serve a Deriv language-model folder over HTTP with the OpenAI API (/v1/chat/completions, /v1/completions, "
        "streaming, continuous batching). Every request is checked before it is decoded; see docs/serving.md. "
        "Needs the serve extra: pip install 'deriv-lm[serve]'."
    )
    parser.add_argument("folder", type=model_folder, help="an exported Deriv language-model folder")
    add_server_arguments(parser, port=8000, max_body_bytes=MAX_BODY_BYTES)  # --host --port --device ...: both servers'
    parser.add_argument(
        "--served-model-name",
        type=served_name,
        default=None,
        help="the model's id in requests and replies (default: the folder's name, never its full path)",
    )
    parser.add_argument(
        "--continuous-batching",
        action="store_true",
        help="decode concurrent requests together in one packed batch over a paged KV cache (every request "
        "then decodes with the folder's sampling settings)",
    )
    parser.add_argument(
        "--cb-num-blocks",
        type=integer(minimum=1, maximum=1 << 20),
        default=None,
        help=f"paged KV cache size in blocks of {PAGE_SIZE} positions (default on the CPU: {CPU_SEQUENCES} full "
        "contexts; on a GPU, transformers sizes it from free memory)",
    )
    parser.add_argument(
        "--cb-max-batch-tokens",
        type=integer(minimum=1, maximum=1 << 20),
        default=None,
        help=f"most tokens in one packed step (default on the CPU: {CPU_BATCH_TOKENS})",
    )
    parser.add_argument(
        "--read-timeout",
        type=number(above=0, maximum=3600),
        default=BODY_SECONDS,
        help=f"seconds a request body may take to arrive; a slower one gets 408 (default: {BODY_SECONDS:g})",
    )
    parser.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a name the Host header may give besides localhost, --host and IP addresses (a proxy's; repeat it for "
        "more). Other names are refused: a page elsewhere cannot reach this server through DNS rebinding",
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=integer(minimum=1, maximum=100_000),
        default=64,
        help="requests decoded or waiting at once; more get 429 (default: 64)",
    )
    add_decode_loop_argument(
        parser,
        "decode each request in Deriv's loop, the whole step compiled into one graph (compiled at start; not with "
        "--continuous-batching)",
    )
    parser.add_argument(
        "--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"), help="auto: the weights' own"
    )
    parser.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    check_flags(ns)
    require_serve_extra("deriv serve")
    device = server.resolve_device(ns.device)
    sock = server.listen(ns.host, ns.port)  # the address first: a port in use is found in a blink, not after loading
    ns.port = sock.getsockname()[1]  # the one the OS chose for --port 0
    try:
        served = load(ns, device)
    except BaseException:
        sock.close()
        raise
    address = server.url(ns.host, ns.port)
    print(f"deriv serve: {served.name} ({ns.folder}) on {address}/v1 (Ctrl-C stops it)", flush=True)
    try:
        serve(served, sock, ns.log_level)
    finally:
        served.engine.stop()
    return 0


def served_name(text: str) -> str:
    """An argparse type: the model's id in requests and replies. Every reply carries it as JSON text, so bytes that
    are not UTF-8 (`$'\\xff'` in a shell, a surrogate in Python's argv) would make every reply, /health too, fail
    to encode: refused as the line is parsed, as are an empty id and a path."""
    why = invalid_text(text)
    if why:
        raise argparse.ArgumentTypeError(f"not valid text: {why}; give the id clients will send as `model`")
    if not text.strip() or text.startswith("/"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give the id clients will send as `model` (not empty, not a path); leave it out for the "
            "folder's name"
        )
    return text


def check_flags(ns: argparse.Namespace) -> None:
    """Flags that cannot do what they say, refused before anything starts."""
    sized = [
        flag
        for flag, value in (("--cb-num-blocks", ns.cb_num_blocks), ("--cb-max-batch-tokens", ns.cb_max_batch_tokens))
        if value is not None
    ]
    if ns.decode_loop and ns.continuous_batching:
        raise UsageError(
            "--decode-loop and --continuous-batching are two ways to decode: the loop runs one request at a time, "
            "batching many; pick one"
        )
    if sized and not ns.continuous_batching:
        raise UsageError(
            f"{' and '.join(sized)} size the paged cache of --continuous-batching, which is off: add "
            "--continuous-batching, or leave them out"
        )


def load(ns: argparse.Namespace, device: str):
    """The folder, loaded as every command loads one (safetensors only, Deriv's classes, the adapter merged), on
    its device, behind the engine the flags ask for."""
    import torch

    from .folder.load import load_folder
    from .serving.app import Served
    from .serving.engines import BatchingEngine, GenerateEngine
    from .tokenization.chat_template import check_template_source

    folder = check_servable(ns.folder)
    loaded = load_folder(folder, seq2seq=False)
    check_template_source(loaded.tokenizer.chat_template, folder)  # {% include %} and the like: refused now
    model = loaded.model
    if ns.dtype != "auto":
        model = model.to(getattr(torch, ns.dtype))
    model = model.to(device).eval()
    generation = model.generation_config
    generation.num_beams = 1  # a server streams: one beam (greedy or sampling), as the OpenAI API decodes
    if ns.continuous_batching:
        from transformers import ContinuousBatchingConfig

        sizes = cpu_batching_options(model.config.max_position_embeddings, device)
        sizes.update(
            {k: v for k, v in (("num_blocks", ns.cb_num_blocks), ("max_batch_tokens", ns.cb_max_batch_tokens)) if v}
        )
        engine = BatchingEngine(model, generation, ContinuousBatchingConfig(**sizes))
    else:
        engine = GenerateEngine(model, generation)
        if ns.decode_loop:
            try:  # on the engine's worker thread, where requests will run it (CUDA graphs are recorded per thread)
                engine.run_on_worker(warm_decode_loop, model, generation, ns.decode_loop, folder)
            except BaseException:
                engine.stop()
                raise
    name = ns.served_model_name or os.path.basename(os.path.normpath(folder))
    return Served(
        name=name,
        model=model,
        tokenizer=loaded.tokenizer,
        engine=engine,
        max_body_bytes=ns.max_body_bytes,
        max_concurrent_requests=ns.max_concurrent_requests,
        aliases=(folder,),
        host=ns.host,
        port=ns.port,
        allowed_hosts=tuple(ns.allow_host),
        body_seconds=ns.read_timeout,
    )


def warm_decode_loop(model, generation, loop: str, folder: str) -> None:
    """Switch the folder's generation config to the decode loop and run it once greedily and once sampling before
    the server listens: both graphs compile now, not in the first request of each kind (every sampling setting is
    an input of the one sampling graph), and a setting of the folder's the loop cannot run is one line now, not a
    failed request later."""
    import torch

    from .modeling_deriv.decode_loop import DecodeLoopUnsupported

    generation.decode_loop = loop
    prompt = torch.tensor([[model.generation_config.bos_token_id or 0]], device=model.device)
    try:
        with torch.no_grad():
            for sample in (False, True):
                extra = {"temperature": 1.0} if sample else {}  # a folder's temperature may be 0 (greedy)
                model.generate(prompt, generation_config=generation, max_new_tokens=2, do_sample=sample, **extra)
    except DecodeLoopUnsupported as error:
        raise UsageError(f"--decode-loop cannot serve {folder} with its generation_config.json: {error}") from None


def serve(served, sock, log_level: str = "warning") -> None:
    """The OpenAI app on `sock` until SIGINT or SIGTERM."""
    from .serving.app import build_app

    server.run_server(build_app(served), sock, log_level)


def check_servable(folder: str | os.PathLike) -> str:
    """The folder, once it is known to hold a Deriv language model; otherwise FileNotFoundError or ValueError
    naming the folder and the problem."""
    from transformers import AutoConfig

    from .folder.load import checked_files
    from .modeling_deriv import DerivConfig

    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise MissingFile(f"{folder}: no such model folder")
    checked_files(folder)  # before transformers reads config.json: no link out, no FIFO among what it reads
    try:
        config = AutoConfig.from_pretrained(folder)  # Deriv's types are registered: no remote code runs
    except Exception as error:
        raise UsageError(f"{folder}: not a model folder ({' '.join(str(error).split())})") from error
    if config.model_type != DerivConfig.model_type:
        kind = "a translation model" if config.is_encoder_decoder else f"a {config.model_type!r} model"
        raise UsageError(
            f"{folder} holds {kind}; deriv serve serves Deriv language models (its endpoints and continuous "
            "batching are decoder-only)"
        )
    return folder


def cpu_batching_options(context: int, device: str) -> dict:
    """The paged-cache sizes for `CPU_SEQUENCES` sequences at the model's full context, on the CPU; nothing
    (transformers' sizing from free memory) on an accelerator."""
    if device != "cpu":
        return {}
    return {"num_blocks": -(-CPU_SEQUENCES * context // PAGE_SIZE), "max_batch_tokens": CPU_BATCH_TOKENS}
