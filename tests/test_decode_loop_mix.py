"""The compiled decode loop serves any mix of sampling settings (issue 50): fifty distinct settings in a row, and
concurrently, through `generate(decode_loop="compiled")` and through `deriv serve --decode-loop compiled`, compile
the step a bounded number of times (greedy search and sampling: two graphs), and every request is answered.

Before, the step ran transformers' processors, whose settings the compiler read as constants: each new temperature
or top-p compiled the step again, and past torch's recompile limit (eight graphs) every new setting failed for good
(`FailOnRecompileLimitHit`, an HTTP 500 from the server). The settings are now tensors the step takes as inputs.

Slow: a compile takes seconds on a laptop's CPU (`compiles` in tests/test_decode_loop.py).
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import ServerThread
from hostile import generate_setting, sampling_setting
from test_decode_loop import compiles, prompt, tiny


SETTINGS = 50
# what may still compile the step for one shape: sampling (one graph for every setting), greedy search with
# penalties and without
MOST_GRAPHS = 3


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.fixture
def fresh_compiler():
    """torch's compile caches emptied: the recompile limit counts per function, across the session's models."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@compiles
def test_fifty_settings_in_a_row_compile_the_step_three_times_at_most(fresh_compiler, caplog):
    """Fifty distinct settings through the compiled loop: three graphs at most (before: eight, then every new setting
    failed), none run uncompiled, and the greedy ones give generate()'s tokens."""
    model, ids = tiny("gpt2", seed=6), prompt(1, 6, seed=10)
    before = compiled_graphs()
    for i in range(SETTINGS):
        setting = generate_setting(i)
        torch.manual_seed(i)
        got = model.generate(ids, max_new_tokens=12, eos_token_id=None, decode_loop="compiled", **setting)
        assert got.shape == (1, 6 + 12)
        if not setting["do_sample"]:
            assert torch.equal(got, model.generate(ids, max_new_tokens=12, eos_token_id=None, **setting)), i
    assert compiled_graphs() - before <= MOST_GRAPHS
    assert "recompile limit" not in caplog.text
    assert not model.__dict__.get("_decode_loop_uncompiled")


def request(i: int) -> dict:
    """The i-th of the server's distinct settings (`hostile.sampling_setting`: every tenth greedy, every
    seventeenth what the API refuses, a 400 naming the field, not the loop's) in a completion request."""
    return {"model": "numbers", "prompt": "5 3 1 8 :", "max_tokens": 8} | sampling_setting(i)


@pytest.fixture
def sampling_folder(tmp_path):
    """tests/data/numbers_lm as trained: its generation config samples (temperature 0.8, top-k 50, top-p 0.95,
    repetition penalty 1.1), so a request's own settings combine with the folder's."""
    folder = tmp_path / "numbers"
    shutil.copytree(Path(__file__).parent / "data" / "numbers_lm", folder)
    return folder


def answered(server, body: dict) -> tuple[int, str | None]:
    status, payload, _ = server.send("POST", "/v1/completions", json.dumps(body).encode())
    assert status == 200 or (status == 400 and payload["error"]["param"] == "temperature"), (status, payload, body)
    return status, payload["choices"][0]["text"] if status == 200 else None


@compiles
@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_deriv_serve_compiled_answers_fifty_settings_in_a_row_and_at_once(sampling_folder, fresh_compiler):
    """`deriv serve --decode-loop compiled` on 127.0.0.1: fifty distinct settings one after another, then fifty more
    from four threads at once: every answer a 200 (or the API's 400 naming the field), never a 500; the step compiled
    twice at most in all (the greedy warm-up, the first sampled request: the folder's repetition penalty applies to
    both); a greedy reply the same each time."""
    before = compiled_graphs()
    server = ServerThread(sampling_folder, "--decode-loop", "compiled")
    try:
        in_a_row = [answered(server, request(i)) for i in range(SETTINGS)]
        with ThreadPoolExecutor(4) as pool:
            at_once = list(pool.map(lambda i: answered(server, request(i)), range(SETTINGS, 2 * SETTINGS)))
        again = answered(server, request(SETTINGS - 1))  # greedy: the same text as the first time
        log = server.log_tail(10**6)
    finally:
        server.stop()
    statuses = [status for status, _ in in_a_row + at_once]
    assert statuses.count(200) == len(statuses) - sum(1 for i in range(2 * SETTINGS) if i % 17 == 16)
    assert again == in_a_row[SETTINGS - 1]
    assert compiled_graphs() - before <= 2
    assert "Traceback" not in log and "recompile limit" not in log and "generate() runs this request" not in log
