"""Shared fixtures: tiny configs and models (CPU, seconds), a tiny byte-level tokenizer, and a
helper that runs Python in a subprocess that cannot import this package."""

import json
import os
import subprocess


# Under pytest-xdist (`make test` runs two workers on the 2-core CI machines) each worker computes with one thread,
# set before torch is imported, so the child processes a test starts inherit it: two workers of two threads each
# would wait on each other. A single process (`make test XDIST=`) keeps torch's default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from deriv_lm import DerivConfig, DerivForCausalLM
from deriv_lm.serving.client import ServerProcess


TINY = dict(
    vocab_size=300,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
    dropout=0.0,
)


# The encoder-decoder's tiny shape, for the tests that build one.
TINY_SEQ2SEQ = dict(
    vocab_size=300,
    hidden_size=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=48,
    dropout=0.0,
)


@pytest.fixture
def tiny_config() -> DerivConfig:
    return DerivConfig(**TINY)


def make_model(seed: int = 0, **overrides) -> DerivForCausalLM:
    torch.manual_seed(seed)
    return DerivForCausalLM(DerivConfig(**{**TINY, **overrides})).eval()


@pytest.fixture
def tiny_model() -> DerivForCausalLM:
    return make_model()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A byte-level BPE of 300 ids (pad=0, bos=1, eos=2, then bytes and a few merges), built in memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = ["the quick brown fox jumps over the lazy dog. " * 4, "a transformer attends to every token. " * 4]
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", padding_side="left"
    )


def run_without_package(code: str, tmp_path, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter that cannot import deriv_lm, offline, from an empty directory
    (the same runner `deriv check` uses)."""
    from deriv_lm.hub_card.check import run_as_hub_user

    return run_as_hub_user(code, tmp_path, timeout=timeout)


def cli_error(argv: list[str], capsys) -> str:
    """Run `deriv argv` in this process; assert it refused with exit status 2 and return its `deriv: error:` line."""
    from deriv_lm.cli import main

    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as stop:  # refused as the line was parsed (argparse exits; a path is checked there too)
        code = stop.code
    assert code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("deriv: error: "), line
    return line


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    """120 documents of the default corpus as JSON lines: the training tests' corpus."""
    from deriv_lm.data import default_corpus

    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    with open(path, "w") as f:
        for i, doc in enumerate(default_corpus()):
            if i >= 120:
                break
            f.write(json.dumps({"text": doc}) + "\n")
    return path


# ---- the served folder: tests/test_serve.py and tests/test_serve_hostile.py ----------------------------------

SERVED_MESSAGES = [{"role": "system", "content": "4 2"}, {"role": "user", "content": "7 1 3"}]


def greedy_numbers_folder(parent, new_tokens: int):
    """A copy of tests/data/numbers_lm (digits in, number words out: each prompt has a continuation of its own,
    so a reply that is not the prompt's cannot match) that decodes greedily, `new_tokens` at most."""
    import shutil
    from pathlib import Path

    from transformers import GenerationConfig

    folder = Path(parent) / "numbers"
    shutil.copytree(Path(__file__).parent / "data" / "numbers_lm", folder)
    (folder / "expected.json").unlink()
    greedy = dict(do_sample=False, eos_token_id=2, pad_token_id=0, bos_token_id=1, max_new_tokens=new_tokens)
    GenerationConfig(**greedy).save_pretrained(folder)
    return folder


def served_reference(folder) -> dict:
    """What generate() gives, in this process, for what the serving tests send: each numbers prompt (read as
    `deriv serve` reads a completion's text) and SERVED_MESSAGES in the chat template; the model and tokenizer."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected = json.loads((Path(__file__).parent / "data" / "numbers_lm" / "expected.json").read_text("utf-8"))
    prompts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in expected["prompts"]]

    def continuation(ids: list[int]) -> str:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids

    chat = tokenizer.apply_chat_template(SERVED_MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    return {
        "completions": {p: continuation(encode(p)) for p in prompts},
        "chat": continuation(chat),
        "model": model,
        "tokenizer": tokenizer,
    }


# ---- a server in this process: the hostile tables of tests/test_serve_hostile.py and tests/test_explore_hostile.py


class ServerThread(ServerProcess):
    """`deriv serve FOLDER FLAGS` (or, with `command="explore"`, `deriv explore FOLDER FLAGS`) in a thread of this
    process: the command's own argument parser, loader and app, served by uvicorn on a free loopback port. The same
    interface as ServerProcess (port, send, post, stream, stop, log_tail; the client half is ServerProcess's own)
    at a fraction of its start-up, for the tests whose subject is what the app answers; what only a process shows
    (the start-up line, signals, exit statuses, resident memory) is tested on a ServerProcess in the slow tier.
    The log is every record logged while it runs (the app's and uvicorn's, tracebacks formatted in), so "no
    traceback in the log" holds it to the same standard; but for what another ServerThread's own thread logs."""

    running: set[int] = set()  # the threads of the ServerThreads serving now

    def __init__(self, folder, *flags: str, command: str = "serve"):
        import argparse
        import io
        import logging
        import threading

        import uvicorn

        from deriv_lm import serve
        from deriv_lm.serving import server

        self.folder, self.command = str(folder), command
        self.sock = server.listen("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        parser = argparse.ArgumentParser()
        if command == "serve":
            serve.add_arguments(parser)
            ns = parser.parse_args([self.folder, "--port", str(self.port), *flags])
            self.served = serve.load(ns, "cpu")
            from deriv_lm.serving.app import build_app

            app = build_app(self.served)
        else:
            from deriv_lm.viz.commands import add_explore_arguments
            from deriv_lm.viz.explorer.app import build_app
            from deriv_lm.viz.explorer.compute import Explorer

            add_explore_arguments(parser)
            ns = parser.parse_args([self.folder, "--port", str(self.port), *flags])
            self.served = None
            app = build_app(Explorer.open(self.folder), "127.0.0.1", self.port, ns.max_body_bytes)
        self._text = io.StringIO()
        self._handler = logging.StreamHandler(self._text)
        self._handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self._handler.addFilter(lambda r: r.thread == self.thread.ident or r.thread not in ServerThread.running)
        # the commands' own uvicorn settings; log_config=None: uvicorn leaves logging as it is, so its records
        # reach the handler below
        self.runner = uvicorn.Server(server.server_config(app, log_config=None))
        self.thread = threading.Thread(target=self.runner.run, kwargs={"sockets": [self.sock]}, daemon=True)
        logging.getLogger().addHandler(self._handler)
        self.thread.start()
        ServerThread.running.add(self.thread.ident)
        while not self.runner.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"deriv {command} did not start:\n{self.log_tail()}")
            self.thread.join(0.05)

    def log_tail(self, characters: int = 3000) -> str:
        return self._text.getvalue()[-characters:]

    def stop(self, timeout: float = 30) -> int:
        """uvicorn's graceful stop, then the engine's; 0 once the thread has ended."""
        import logging

        self.runner.should_exit = True
        self.thread.join(timeout)
        ServerThread.running.discard(self.thread.ident)
        if self.served is not None:
            self.served.engine.stop()
        self.sock.close()
        logging.getLogger().removeHandler(self._handler)
        return 1 if self.thread.is_alive() else 0


@pytest.fixture
def fresh_dynamo():
    """torch's compile caches cleared: the compilations of the decode loop's step by earlier tests in this process
    (other files compile it for their own models) count toward torch's recompile limit, past which the loop runs its
    step uncompiled, and a test of the compiled step would test the fallback (test_decode_loop's `compiles`)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
