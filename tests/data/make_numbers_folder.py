"""Makes the two folders `test_cache_guard.py` decodes: tiny models trained on digits and English number words.

    python tests/data/make_numbers_folder.py        (about a minute on 2 CPU cores)

- numbers_en/: the encoder-decoder, "5 3 1 8" -> "five thousand three hundred eighteen";
- numbers_lm/: the decoder alone, on lines "5 3 1 8 : five thousand three hundred eighteen".

The guard decodes them under whatever transformers and torch are installed and compares the text with
numbers_en/expected.json, written here by uncached decoding (every step recomputes the whole prefix, so no
cache, whatever its name, is involved). The task makes a broken cache visible: every output is a different
sentence that must follow the source digit by digit, where a model that repeats one token would hide a decoder
that has lost its past.

Only what loading needs is kept: config, weights, generation config, tokenizer. No modeling code (the folders
load with the installed classes), no run record.
"""

import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer, GenerationConfig

from deriv_lm.cli import main


DATA = Path(__file__).parent
HERE = DATA / "numbers_en"
ONES = "zero one two three four five six seven eight nine".split()
TEENS = "ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen".split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
KEEP = ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
# Held out from training: the sentences the guard decodes.
SOURCES = ["5 3 1 8", "2 0 7", "9 9 4 1", "1 6", "7 0 0 3", "4 8 2 5", "3 1 9", "6 0 5 2"]


def words(n: int) -> str:
    """English number words for 0 <= n < 10000: 5318 -> 'five thousand three hundred eighteen'."""
    parts = []
    if n >= 1000:
        parts += [ONES[n // 1000], "thousand"]
    if n % 1000 >= 100:
        parts += [ONES[n % 1000 // 100], "hundred"]
    rest = n % 100
    if rest >= 20:
        parts += [TENS[rest // 10]] + ([ONES[rest % 10]] if rest % 10 else [])
    elif rest >= 10:
        parts.append(TEENS[rest - 10])
    elif rest or not parts:
        parts.append(ONES[rest])
    return " ".join(parts)


def digits(n: int) -> str:
    return " ".join(str(n))


def keep(run: Path, folder: Path) -> None:
    """Copy what loading needs from an exported `run` folder into `folder`, without the links to modeling files."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for name in KEEP:
        shutil.copy(run / name, folder / name)
    config = json.loads((folder / "config.json").read_text())
    for key in ("auto_map", "custom_pipelines"):  # they name modeling files the folder does not keep
        config.pop(key, None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def train(task: str, rows: list[str], suffix: str, flags: str) -> Path:
    """Run `deriv train TASK` on `rows` written to a file in a temporary folder; return the exported folder."""
    tmp = Path(tempfile.mkdtemp())
    data = tmp / f"data{suffix}"
    data.write_text("".join(row + "\n" for row in rows), encoding="utf-8")
    run = tmp / "run"
    code = main(
        ["train", task, "--files", str(data), "--output-dir", str(run), "--no-progress", "--cpu"] + flags.split()
    )
    if code != 0:
        sys.exit(code)
    return run


def decode(model, tokenizer, **settings) -> list[str]:
    batch = tokenizer(SOURCES, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=24, **settings)
    return tokenizer.batch_decode(out, skip_special_tokens=True)


def make() -> None:
    held_out = {int(s.replace(" ", "")) for s in SOURCES}
    numbers = [n for n in range(10000) if n not in held_out]
    random.Random(0).shuffle(numbers)
    flags = "--context-length 16 --hidden-size 64 --num-hidden-layers 2 --num-attention-heads 4"
    flags += " --intermediate-size 128 --batch-size 32 --pre-norm --warmup-steps 100 --learning-rate 3e-3"
    flags += " --dropout 0.0 --eval-every 500"
    pairs = [f"{digits(n)}\t{words(n)}" for n in numbers[:6000]]
    run = train(
        "translation", pairs, ".tsv", flags + " --vocab-size 300 --max-steps 3000 --save-every 3000 --num-beams 3"
    )
    keep(run, HERE)
    shutil.rmtree(run.parent)
    lines = [json.dumps({"text": f"{digits(n)} : {words(n)}"}) for n in numbers[:6000]]
    flags = flags.replace("--context-length 16", "--context-length 64")
    run = train("lm", lines, ".jsonl", flags + " --vocab-size 300 --max-steps 1500 --save-every 1500")
    keep(run, DATA / "numbers_lm")
    shutil.rmtree(run.parent)

    tokenizer = AutoTokenizer.from_pretrained(HERE, padding_side="left")
    model = AutoModelForSeq2SeqLM.from_pretrained(HERE).eval()
    expected = {
        "made_with": {"transformers": transformers.__version__, "torch": torch.__version__},
        "sources": SOURCES,
        "references": [words(int(s.replace(" ", ""))) for s in SOURCES],
        "greedy": decode(model, tokenizer, do_sample=False, num_beams=1, use_cache=False),
        "beam": decode(model, tokenizer, do_sample=False, num_beams=3, use_cache=False),
    }
    (HERE / "expected.json").write_text(json.dumps(expected, indent=2, ensure_ascii=False) + "\n")
    print(json.dumps(expected, indent=2, ensure_ascii=False))

    # The decoder continues "5 3 1 8 :" with the words and <eos>.
    # Plain greedy, not the folder's generation defaults (sampling, a repetition penalty).
    tokenizer = AutoTokenizer.from_pretrained(DATA / "numbers_lm")
    model = AutoModelForCausalLM.from_pretrained(DATA / "numbers_lm").eval()
    prompts = [tokenizer(f"{source} :").input_ids for source in SOURCES]
    model.generation_config = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=0)
    with torch.no_grad():
        continuations = [
            model.generate(torch.tensor([ids]), use_cache=False)[0, len(ids) :].tolist() for ids in prompts
        ]
    expected = {
        "made_with": {"transformers": transformers.__version__, "torch": torch.__version__},
        "prompts": prompts,
        "greedy": continuations,
        "text": [tokenizer.decode(ids) for ids in continuations],
    }
    (DATA / "numbers_lm" / "expected.json").write_text(json.dumps(expected, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    make()
