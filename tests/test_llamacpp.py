"""`deriv export --to gguf` run in llama.cpp (through llama-cpp-python): a tiny Llama-shaped Deriv folder with
grouped-query attention (unscaled and bias-free as Llama; and scaled with biases as the llama-tiny preset) decodes
greedily to Deriv's own tokens from the f32 file, and llama.cpp tokenizes a text
as the folder's tokenizer does. f16 and q8_0 agreement is measured and printed (`-s`), not asserted.

llama-cpp-python compiles llama.cpp from source (about 13 minutes on 2 cores), so it is no extra: this file runs
in `make test-llamacpp`'s own environment and skips everywhere llama_cpp does not import."""

import numpy as np
import pytest
import torch
from conftest import TINY


pytestmark = pytest.mark.llamacpp
llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make test-llamacpp)")
pytest.importorskip("gguf", reason="the runtimes extra is not installed (pip install 'deriv-lm[runtimes]')")

from deriv_lm import DerivConfig, DerivForCausalLM  # noqa: E402
from deriv_lm.convert import export_model  # noqa: E402
from deriv_lm.convert.llama import LLAMA_SWITCHES  # noqa: E402


LLAMA = dict(
    **LLAMA_SWITCHES,  # pre-norm, rotary, RMSNorm, gated
    scale_embedding=False,  # Llama's own: a tied twin (a scaled folder's, untied: tests/test_convert_llama.py)
    hidden_act="silu",
    bias=False,
    num_key_value_heads=2,
    rope_theta=500000.0,  # not the default: a file that dropped the base would decode other tokens
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# the llama-tiny preset's: the paper's sqrt(d) embedding and biases, so the file has token_embd = sqrt(d) E, an
# output of its own and each projection's bias (docs/convert.md)
SCALED_BIASED = dict(scale_embedding=True, bias=True)
PROMPT = [1, 50, 60, 70, 80]
NEW = 16


@pytest.fixture(scope="module", params=[{}, SCALED_BIASED], ids=["llama", "scaled embedding and biases"])
def llama_folder(request, tmp_path_factory, tiny_tokenizer):
    """Every parameter redrawn (norm gains around 1), so the greedy tokens vary from step to step."""
    model = DerivForCausalLM(DerivConfig(**{**TINY, **LLAMA, **request.param})).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=g) * 0.3 + (1.0 if "norm" in name else 0.0))
    folder = tmp_path_factory.mktemp("llamacpp") / "llama"
    model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return model, folder


def llama_cpp_greedy(path) -> tuple[list[int], object]:
    """llama.cpp's greedy tokens: argmax of the last row of the logits, one token at a time. subtle: without
    logits_all=True `scores` stays zeros, and every argmax is token 0."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    llm.eval(PROMPT)
    tokens = []
    for _ in range(NEW):
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([tokens[-1]])
    return tokens, llm


def test_llama_cpp_decodes_derivs_greedy_tokens_from_the_f32_file(llama_folder, tmp_path, tiny_tokenizer):
    model, folder = llama_folder
    with torch.no_grad():
        expected = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0
        )[0, len(PROMPT) :].tolist()
    assert len(set(expected)) > 2, expected  # not one token repeated
    for outtype in ("f32", "f16", "q8_0"):
        got, llm = llama_cpp_greedy(export_model(folder, "gguf", tmp_path / f"m-{outtype}.gguf", outtype=outtype))
        same = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), NEW)
        print(f"llama.cpp {outtype}: {same}/{NEW} leading greedy tokens agree with Deriv")
        if outtype == "f32":
            assert got == expected
            # punctuation runs, digit groups and a leading space, where llama.cpp's pre-tokenizers differ
            text = 'the quick brown fox 123\nok f(x) = 1234, "ok"!! $5 (x)'
            assert llm.tokenize(text.encode(), add_bos=False, special=False) == tiny_tokenizer(text).input_ids
