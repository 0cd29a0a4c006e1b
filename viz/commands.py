"""`deriv attention`, `deriv picture ...` and `deriv explore`: the command-line side of the pictures and the page."""

from __future__ import annotations

import argparse
import os
import sys

from ..arguments import command_name, existing_folder, integer, model_folder, number, plain_text
from ..errors import MissingFile, UsageError, require_extra


# `picture positions` draws a positions x dim table and a positions x positions map of dot products, each on some
# 400 x 400 pixels: 4096 positions (four times GPT-2's context) is already ten to a pixel, and takes seconds (8192,
# four times the pixels, takes a dozen). 4096 dimensions is the width of a 7B-parameter model.
MAX_POSITIONS = 4096
MAX_DIM = 4096
# `picture kv-memory` allocates the caches it measures; the largest, the static one at --context and the largest
# of --batches, may take at most this much. 2 GiB holds the default shape's at batch 455, GPT-2's at 28.
MAX_KV_BYTES = 2 * 2**30
# The explorer's request bodies: a prompt at GPT-2's whole context (1024 tokens) is some 5 KB of text or 7 KB of ids.
EXPLORE_BODY_BYTES = 256 * 1024


def add_attention_arguments(att: argparse.ArgumentParser) -> None:
    """`deriv attention FOLDER TEXT`."""
    att.add_argument("folder", type=model_folder)
    add_trust_argument(att)
    att.add_argument("text", type=plain_text)
    att.add_argument(
        "--target", type=plain_text, default=None, help="translation: the target text (default: the model's own)"
    )
    att.add_argument("--layers", type=integer(minimum=0), nargs="+", default=None, help="layer indices (default: all)")
    att.add_argument("--heads", type=integer(minimum=0), nargs="+", default=None, help="head indices (default: all)")
    att.add_argument("--average", action="store_true", help="one panel per layer: the mean over heads")
    att.add_argument(
        "--kind", choices=["encoder", "decoder", "cross", "all"], default="all", help="translation: which attention"
    )
    att.add_argument("--out", default="attention.png", help="output PNG (translation: one file per kind, suffixed)")
    att.set_defaults(func=_plotting(run_attention))


def add_picture_arguments(pic: argparse.ArgumentParser) -> None:
    """`deriv picture positions|tokens|temperature|curves|kv-memory`."""
    kinds = pic.add_subparsers(dest="picture", required=True)
    pos = kinds.add_parser("positions", help="the sinusoidal position table and the dot products between positions")
    pos.add_argument("--positions", type=integer(minimum=1, maximum=MAX_POSITIONS), default=64)
    pos.add_argument(
        "--dim", type=integer(minimum=2, maximum=MAX_DIM), default=128, help="an even number: sin and cos pairs"
    )
    pos.add_argument("--out", default="positions.png")
    pos.set_defaults(func=_plotting(lambda ns: _done(_positions(ns))))
    tok = kinds.add_parser("tokens", help="how a folder's tokenizer splits a text (a model's or a tokenizer's folder)")
    tok.add_argument("folder", type=existing_folder)
    add_trust_argument(tok)
    tok.add_argument(
        "text", type=plain_text, help="counted whole; the picture draws its first tokens (a note says where it stops)"
    )
    tok.add_argument("--out", default="tokens.png")
    tok.set_defaults(func=_plotting(lambda ns: _done(_tokens(ns))))
    tmp = kinds.add_parser("temperature", help="next-token distribution at several temperatures, top-k/top-p marked")
    tmp.add_argument("folder", type=model_folder)
    add_trust_argument(tmp)
    tmp.add_argument("text", type=plain_text)
    tmp.add_argument(
        "--temperatures", type=number(above=0), nargs="+", default=[0.5, 1.0, 2.0], help="two or more, to compare"
    )
    tmp.add_argument("--top-k", type=integer(minimum=1), default=10)
    tmp.add_argument("--top-p", type=number(above=0, maximum=1), default=0.9)
    tmp.add_argument("--out", default="temperature.png")
    tmp.set_defaults(func=_plotting(lambda ns: _done(_temperature(ns))))
    cur = kinds.add_parser("curves", help="the training curves of a trained folder")
    cur.add_argument("folder")
    cur.add_argument("--out", default="curves.png")
    cur.set_defaults(func=_plotting(lambda ns: _done(_curves(ns))))
    kv = kinds.add_parser(
        "kv-memory", help="KV-cache memory against context length and batch, Deriv and GPT-2 measured, and the formula"
    )
    from ..bench.decoder import add_shape_arguments

    add_shape_arguments(kv)
    kv.add_argument("--positions", type=integer(minimum=1), nargs="+", default=[16, 32, 64, 128, 192, 256])
    kv.add_argument("--batches", type=integer(minimum=1), nargs="+", default=[1, 8])
    kv.add_argument("--out", default="kv-memory.png")
    kv.set_defaults(func=_plotting(lambda ns: _done(_kv_memory(ns))))


def add_explore_arguments(parser: argparse.ArgumentParser) -> None:
    """`deriv explore FOLDER [--host --port --device --max-body-bytes --log-level]`."""
    from ..serving.server import MAX_BODY_BYTES, add_server_arguments

    parser.description = (
        "Open a local web page on a Deriv folder (decoder, translation, chat-tuned, imported or int8): its tokens "
        "and merges, embeddings and positions, every attention map, the next-token distribution under the "
        "sampling controls, and generation step by step with the KV cache's size; see docs/explore.md. Needs the "
        "serve extra: pip install 'deriv-lm[serve]'."
    )
    parser.add_argument("folder", type=local_model_folder, help="a Deriv model folder on this machine")
    add_server_arguments(parser, port=8008, max_body_bytes=EXPLORE_BODY_BYTES, body_limit=MAX_BODY_BYTES)
    parser.set_defaults(func=run_explore)


def local_model_folder(text: str) -> str:
    """An argparse type: `model_folder`, and not a file. (A name that may be the Hub's is refused as the command
    starts: the explorer opens folders on this machine only.)"""
    if os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text} is a file; deriv explore opens a model folder")
    return model_folder(text)


def run_explore(ns: argparse.Namespace) -> int:
    """Check everything that can be checked before listening (the extra, the folder's type, the device, the
    address), then load the folder and serve the page until Ctrl-C or SIGTERM."""
    from ..serving import server

    if not os.path.isdir(ns.folder):
        raise MissingFile(f"{ns.folder}: no such model folder (deriv explore opens one on this machine)")
    server.require_serve_extra("deriv explore")
    from ..folder.load import check_model_type, checked_files, read_folder

    checked_files(ns.folder)  # no link out, no FIFO among what the load will read: refused before listening
    check_model_type(ns.folder, read_folder(ns.folder).config.get("model_type"), consent=None)
    device = server.resolve_device(ns.device)
    sock = server.listen(ns.host, ns.port)  # the address first: a port in use is found in a blink, not after loading
    ns.port = sock.getsockname()[1]  # the one the OS chose for --port 0
    try:
        from .explorer.app import build_app
        from .explorer.compute import Explorer

        explorer = Explorer.open(ns.folder, device=device)
        app = build_app(explorer, ns.host, ns.port, ns.max_body_bytes)
    except BaseException:
        sock.close()
        raise
    name = os.path.basename(os.path.normpath(ns.folder))
    print(f"deriv explore: {name} ({ns.folder}) on {server.url(ns.host, ns.port)} (Ctrl-C stops it)", flush=True)
    server.run_server(app, sock, ns.log_level)
    return 0


def add_trust_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the Python files of a folder that is not Deriv's (Deriv's own folders never need it)",
    )


def _plotting(draw):
    """Run a drawing command, once matplotlib is found (else one line: the pip line of the viz extra)."""

    def run(ns: argparse.Namespace) -> int:
        require_extra("viz", command_name(ns))  # before any model is loaded
        return draw(ns)

    return run


def _done(paths) -> int:
    for path in [paths] if isinstance(paths, str) else paths:
        print(f"wrote {path}")
    return 0


def run_attention(ns: argparse.Namespace) -> int:
    from .attention import attention_maps, load_eager, plot_attention, select

    model, tokenizer = load_eager(ns.folder, trust_remote_code=ns.trust_remote_code)
    try:
        maps = attention_maps(model, tokenizer, ns.text, ns.target)
        kinds = list(maps) if ns.kind == "all" else [ns.kind]
        if ns.kind not in ("all", *maps):
            raise UsageError(f"{ns.folder} has no {ns.kind} attention; it has {', '.join(maps)}")
        chosen = {kind: select(maps[kind], ns.layers, ns.heads) for kind in kinds}
    except IndexError as error:
        raise UsageError(str(error)) from error
    layer_names = ns.layers
    paths = []
    for kind, m in chosen.items():
        stem, ext = os.path.splitext(ns.out)
        path = ns.out if len(chosen) == 1 else f"{stem}-{kind}{ext or '.png'}"
        paths.append(plot_attention(m, path, average=ns.average, layer_names=layer_names)[0])
    return _done(paths)


def _positions(ns):
    from .pictures import positional_encoding

    if ns.dim % 2:
        raise UsageError(f"--dim {ns.dim}: the sinusoidal table pairs a sine and a cosine, so it must be even")
    return positional_encoding(ns.out, ns.positions, ns.dim)


def _tokens(ns):
    from transformers import AutoTokenizer

    from ..folder.load import checked_files
    from ..folder.remote_code import check_tokenizer_code
    from .pictures import MAX_TOKENS_DRAWN, token_split

    if os.path.isdir(ns.folder):  # transformers reads whatever tokenizer files it finds: no link out, no FIFO
        checked_files(ns.folder)
    check_tokenizer_code(ns.folder, ns.trust_remote_code)  # its own code: only with --trust-remote-code
    try:
        tokenizer = AutoTokenizer.from_pretrained(ns.folder, trust_remote_code=ns.trust_remote_code)
    except Exception as error:
        raise UsageError(f"{ns.folder}: no tokenizer there ({error})") from error
    count = len(tokenizer(ns.text, add_special_tokens=False).input_ids)
    if count > MAX_TOKENS_DRAWN:
        print(f"deriv: note: {count} tokens; the picture draws the first {MAX_TOKENS_DRAWN}", file=sys.stderr)
    return token_split(tokenizer, ns.text, ns.out)


def _temperature(ns):
    from .pictures import temperature

    if len(ns.temperatures) < 2:
        raise UsageError("--temperatures needs two or more values: the picture compares them")
    from .attention import load_eager

    model, tokenizer = load_eager(ns.folder, trust_remote_code=ns.trust_remote_code)
    if model.config.is_encoder_decoder:
        raise UsageError(
            "`picture temperature` draws a language model's next-token distribution; this is a translation model"
        )
    return temperature(model, tokenizer, ns.text, ns.out, tuple(ns.temperatures), ns.top_k, ns.top_p)


def _curves(ns):
    from ..folder.load import checked_files
    from .pictures import curves

    if os.path.isdir(ns.folder):  # a metrics.jsonl that is a link out or a FIFO: refused by name, never opened
        checked_files(ns.folder)
    try:
        return curves(ns.folder, ns.out)
    except FileNotFoundError as error:
        raise UsageError(str(error)) from error


def _kv_memory(ns):
    # the measurement is the inference bench's (it builds Deriv and GPT-2 at one shape); the drawing is this room's
    from ..bench.inference import build_models, kv_formula_bytes, kv_memory_rows
    from .pictures import kv_memory

    if max(ns.positions) > ns.context:
        raise UsageError(f"--positions {max(ns.positions)}: past the models' --context {ns.context}")
    static = kv_formula_bytes(ns.layers, ns.context, ns.hidden, 4, max(ns.batches))
    if static > MAX_KV_BYTES:
        fits = MAX_KV_BYTES // kv_formula_bytes(ns.layers, ns.context, ns.hidden, 4, 1)
        allowed = f"--batches <= {fits} at this shape" if fits else "lower --context, --hidden or --layers"
        raise UsageError(
            f"--batches {max(ns.batches)}: the static KV cache at --context {ns.context} would take "
            f"{static / 2**30:.1f} GiB (2 x {ns.layers} layers x {ns.context} x {ns.hidden} x 4 B x batch), past the "
            f"{MAX_KV_BYTES // 2**30} GiB this picture allocates at most: {allowed}"
        )
    rows = kv_memory_rows(build_models(ns), ns, ns.batches, ns.positions)
    return kv_memory(rows, ns.out, ns.layers, ns.hidden, ns.context)
