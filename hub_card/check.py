"""`deriv check FOLDER`: load a folder the way a Hub user would, and say what works.

The steps run in a fresh interpreter that cannot import this package (an import hook hides it, as if it
were not installed), offline (`HF_HUB_OFFLINE=1`), from an empty working directory, with the dynamic
module cache in a temporary folder: so they pass only if the folder alone is enough. Before the process starts,
every entry of the folder it may read is known to be a regular file inside it (`folder/inside.py`), and a shard
index to name only shards inside it: the check never reads past the folder, nor blocks on a FIFO.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

from ..errors import MissingFile
from ..folder.load import SAFETENSORS, check_safetensors, check_shard_index, checked_files, read_folder


HIDE_PACKAGE = textwrap.dedent(
    """
    import sys

    class _HideDeriv:
        # A Hub user's machine: this package is not installed.
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("deriv_lm", "modeling_deriv"):
                raise ModuleNotFoundError(f"No module named {name!r} (hidden: a Hub user does not have it)")
            return None

    sys.meta_path.insert(0, _HideDeriv())
    """
)


def run_as_hub_user(code: str, workdir: str | os.PathLike, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter that cannot import deriv_lm, offline, from `workdir` (made empty)."""
    workdir = str(workdir)
    script = os.path.join(workdir, "hub_user.py")
    cwd = os.path.join(workdir, "cwd")
    os.makedirs(cwd, exist_ok=True)
    with open(script, "w", encoding="utf-8") as f:
        f.write(HIDE_PACKAGE + textwrap.dedent(code) + "\nassert 'deriv_lm' not in sys.modules\n")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_MODULES_CACHE": os.path.join(workdir, "hf_modules"),
        "HF_HOME": os.path.join(workdir, "hf_home"),
        "PYTHONPATH": "",
    }
    return subprocess.run(
        [sys.executable, script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


# Each step prints one JSON line; a step that fails stops the ones that need it.
_STEPS = """
import json, traceback

def report(step, ok, detail):
    print(json.dumps({{"step": step, "ok": ok, "detail": detail}}), flush=True)

def attempt(step, fn):
    try:
        detail = fn()
    except BaseException as error:  # the user sees the message, not a traceback
        report(step, False, f"{{type(error).__name__}}: {{error}}".splitlines()[0][:500])
        return False
    report(step, True, detail)
    return True

import torch
from transformers import AutoConfig, AutoTokenizer, {auto}, pipeline

folder, state = {folder!r}, {{}}

def config():
    state["config"] = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    return type(state["config"]).__name__ + " (model_type " + state["config"].model_type + ")"

def tokenizer():
    state["tokenizer"] = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    return f"{{type(state['tokenizer']).__name__}}, {{len(state['tokenizer'])}} tokens"

def model():
    state["model"] = {auto}.from_pretrained(folder, trust_remote_code=True).eval()
    n = sum(p.numel() for p in state["model"].parameters())
    return f"{{type(state['model']).__name__}} via {auto}, {{n:,}} parameters"

def generate():
    tok, m = state["tokenizer"], state["model"]
    inputs = tok([{prompt!r}], return_tensors="pt")
    with torch.no_grad():
        out = m.generate(**inputs, max_new_tokens=5, do_sample=False, num_beams=1)
    new = out[0] if m.config.is_encoder_decoder else out[0, inputs["input_ids"].shape[1]:]
    return repr({prompt!r}) + " -> " + repr(tok.decode(new, skip_special_tokens=True))

def make_pipeline():
    pipe = {pipeline_call}
    out = pipe({prompt!r}, max_new_tokens=5)
    return type(pipe).__name__ + ": " + repr(out)[:200]

ok = attempt("config", config)
ok = attempt("tokenizer", tokenizer) and ok
ok = ok and attempt("model", model)
ok = ok and attempt("generate", generate)
ok = ok and attempt("pipeline", make_pipeline)
"""


def check_folder(path: str | os.PathLike, timeout: int = 300) -> list[dict]:
    """[{"step", "ok", "detail"}] for config, tokenizer, model, generate and pipeline, in that order; a step that
    never ran (because one it needs failed) is reported as failed with the reason."""
    folder = read_folder(path)
    checked_files(path)  # the process below reads what it finds: no link out, no FIFO among it
    if not (folder.has(SAFETENSORS[0]) or folder.has(SAFETENSORS[1])):
        raise MissingFile(f"{path}: model.safetensors is missing, so there is no model to check")
    if folder.has(SAFETENSORS[1]):
        check_shard_index(path)
    check_safetensors(path)
    path = os.path.abspath(str(path))
    if folder.is_seq2seq:
        auto, prompt = "AutoModelForSeq2SeqLM", "Open the file"
        pipeline_call = "pipeline(model=folder, trust_remote_code=True)"  # the folder's custom_pipelines
    else:
        auto, prompt = "AutoModelForCausalLM", "The"
        pipeline_call = 'pipeline("text-generation", model=folder, trust_remote_code=True)'
    code = _STEPS.format(auto=auto, folder=path, prompt=prompt, pipeline_call=pipeline_call)
    with tempfile.TemporaryDirectory(prefix="deriv-check-") as workdir:
        result = run_as_hub_user(code, workdir, timeout=timeout)
    steps = []
    for line in result.stdout.splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and "step" in entry:
            steps.append(entry)
    seen = {s["step"] for s in steps}
    for name in ("config", "tokenizer", "model", "generate", "pipeline"):
        if name not in seen:
            reason = "not run: an earlier step failed"
            if result.returncode != 0 and not any(not s["ok"] for s in steps):
                reason = f"the check process failed: {result.stderr.strip().splitlines()[-1:] or ['no output']}"
            steps.append({"step": name, "ok": False, "detail": reason})
    return steps
