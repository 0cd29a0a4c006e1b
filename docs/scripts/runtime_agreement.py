# ruff: noqa: B905, E402, E731  (a measurement script, kept as it ran)
"""How often Llama, CTranslate2 and llama.cpp decode a TRAINED Deriv folder as Deriv's generate() does: the numbers
of docs/results.md ("Out to CTranslate2 and llama.cpp"). Needs the runtimes extra; llama.cpp's rows where
llama_cpp imports (make test-llamacpp's environment). Greedy and 4-beam, 32 new tokens after the first 8 tokens
of 24 held-out docstrings (idlelib, tkinter: not in the default corpus); the translator on 29 short sources.

usage: python docs/scripts/runtime_agreement.py runs/deriv-llama-tiny runs/deriv-translate-tiny OUT_DIR
"""

import json
import os
import sys

import ctranslate2
import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer, LlamaForCausalLM

from deriv_lm.convert import export_model


llama_dir, mt_dir, out = sys.argv[1:4]
os.makedirs(out, exist_ok=True)
torch.manual_seed(0)
results = {}
NEW = 32


def lead(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# prompts: first 8 tokens of 24 held-out docstrings (idlelib/tkinter, never trained on)
import ast
import importlib
import inspect


docs = []
for mod in ("idlelib.editor", "idlelib.search", "tkinter.filedialog", "tkinter.font", "tkinter.ttk", "idlelib.config"):
    src = inspect.getsource(importlib.import_module(mod))
    for node in ast.walk(ast.parse(src)):
        if (
            isinstance(node, (ast.FunctionDef, ast.ClassDef))
            and ast.get_docstring(node)
            and len(ast.get_docstring(node)) > 40
        ):
            docs.append(ast.get_docstring(node))
docs = docs[:24]

tok = AutoTokenizer.from_pretrained(llama_dir)
model = AutoModelForCausalLM.from_pretrained(llama_dir).eval()
prompts = [tok(d).input_ids[:8] for d in docs]


def deriv_gen(m, p, beams=1):
    with torch.no_grad():
        return m.generate(
            torch.tensor([p]),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            num_beams=beams,
            pad_token_id=tok.pad_token_id,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
        )[0, len(p) :].tolist()


ref = {b: [deriv_gen(model, p, b) for p in prompts] for b in (1, 4)}

# Llama export
native_dir = export_model(llama_dir, "llama", os.path.join(out, "llama-native"))
native = LlamaForCausalLM.from_pretrained(native_dir).eval()
x = torch.tensor(
    [tok(d).input_ids[:96] for d in docs[:8] if len(tok(d).input_ids) >= 96] or [tok(docs[0]).input_ids[:32]]
)
with torch.no_grad():
    dl = (model(x).logits - native(x).logits).abs().max().item()
results["llama"] = {
    "max_abs_logit_diff": dl,
    "max_abs_logit": model(x).logits.abs().max().item(),
    "greedy_equal": sum(deriv_gen(native, p) == r for p, r in zip(prompts, ref[1])),
    "beam4_equal": sum(deriv_gen(native, p, 4) == r for p, r in zip(prompts, ref[4])),
    "n": len(prompts),
}
print("llama", results["llama"], flush=True)

# CTranslate2 decoder
for q in ("float32", "int8"):
    d = export_model(llama_dir, "ctranslate2", os.path.join(out, f"ct2-{q}"), quantization=q)
    gen = ctranslate2.Generator(d, device="cpu")
    row = {}
    for beams in (1, 4):
        got = [
            gen.generate_batch(
                [tok.convert_ids_to_tokens(p)],
                beam_size=beams,
                max_length=NEW,
                min_length=NEW,
                include_prompt_in_result=False,
            )[0].sequences_ids[0]
            for p in prompts
        ]
        row[f"beams{beams}_sequences_equal"] = sum(g == r for g, r in zip(got, ref[beams]))
        row[f"beams{beams}_tokens_agree"] = sum(lead(g, r) for g, r in zip(got, ref[beams]))
    row["n"], row["tokens"] = len(prompts), len(prompts) * NEW
    results[f"ct2_llama_{q}"] = row
    print(q, row, flush=True)

# llama.cpp
try:
    import llama_cpp

    for ot in ("f32", "f16", "q8_0"):
        try:
            path = export_model(llama_dir, "gguf", os.path.join(out, f"m-{ot}.gguf"), outtype=ot)
        except Exception as e:
            print(ot, "refused:", e)
            results[f"llamacpp_{ot}"] = str(e)
            continue
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=128, n_threads=2, logits_all=True, verbose=False)
        eq = agree = 0
        for p, r in zip(prompts, ref[1]):
            llm.reset()
            llm.eval(p)
            got = []
            for _ in range(NEW):
                got.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
                llm.eval([got[-1]])
            eq += got == r
            agree += lead(got, r)
        results[f"llamacpp_{ot}"] = {
            "sequences_equal": eq,
            "tokens_agree": agree,
            "n": len(prompts),
            "tokens": len(prompts) * NEW,
        }
        print(ot, results[f"llamacpp_{ot}"], flush=True)
except ImportError as e:
    print("no llama_cpp", e)

# translator: CTranslate2 over 40 validation sources
mtok = AutoTokenizer.from_pretrained(mt_dir)
mt = AutoModelForSeq2SeqLM.from_pretrained(mt_dir).eval()
srcs = [d.split(".")[0][:80] for d in docs] + [
    "Open the file",
    "Save the document?",
    "The file already exists",
    "Cannot open the folder",
    "Quit without saving?",
]
srcs = srcs[:29]


def mt_gen(src, beams):
    with torch.no_grad():
        ids = mtok(src, return_tensors="pt")
        return mt.generate(
            **ids, max_new_tokens=NEW, do_sample=False, num_beams=beams, no_repeat_ngram_size=0, repetition_penalty=1.0
        )[0, 1:].tolist()


mref = {b: [mt_gen(s, b) for s in srcs] for b in (1, 4)}
for q in ("float32", "int8"):
    d = export_model(mt_dir, "ctranslate2", os.path.join(out, f"ct2-mt-{q}"), quantization=q)
    tr = ctranslate2.Translator(d, device="cpu")
    row = {}
    for beams in (1, 4):
        got = []
        for s in srcs:
            toks = mtok.convert_ids_to_tokens(mtok(s).input_ids)
            hyp = tr.translate_batch([toks], beam_size=beams, max_decoding_length=NEW)[0].hypotheses[0]
            got.append(mtok.convert_tokens_to_ids(hyp))
        # Deriv's output ends in </s> where it stops; compare without specials
        strip = lambda t: [i for i in t if i not in (mtok.pad_token_id, mtok.eos_token_id)]
        row[f"beams{beams}_equal"] = sum(strip(g) == strip(r) for g, r in zip(got, mref[beams]))
    row["n"] = len(srcs)
    results[f"ct2_translator_{q}"] = row
    print("mt", q, row, flush=True)
json.dump(results, open(os.path.join(out, "agreement.json"), "w"), indent=1)
