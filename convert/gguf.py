"""A Llama-shaped Deriv folder as one GGUF file, the format llama.cpp (and Ollama, LM Studio, ...) runs.

`deriv export FOLDER --to gguf --out FILE.gguf [--outtype f32|f16|q8_0]` writes the file with the `gguf`
package's `GGUFWriter`, the writer llama.cpp's own converter uses (that converter is a script inside llama.cpp's
repository, not in the package, and it refuses a tokenizer whose pre-tokenizer it cannot name by hash, which every
Deriv tokenizer is). Architecture "llama": the folder must have Llama's switches, which `llama.llama_config`
checks and names when one is off. The file is the Llama twin's (`llama.to_llama`), so a scaled embedding goes in as
the twin has it: `token_embd` = sqrt(d) E and an `output` of its own (E, or the folder's untied head).

What goes in:
- the hyperparameters llama.cpp reads for "llama" (context, width, blocks, FFN width, heads, kv heads, the rotary
  dimension and base, the RMSNorm epsilon);
- the weights under GGUF's names (`token_embd`, `blk.N.attn_q`, ..., `output_norm`, `output` when the twin is
  untied), in the HF (out, in) layout the writer expects. q and k rows are permuted: Deriv and transformers rotate
  in the "half" layout (dimension j pairs with j + head_dim/2), llama.cpp in the interleaved one (2i with 2i+1),
  the same permutation llama.cpp's converter applies;
- with bias=True, each projection's bias under the same name (`blk.N.attn_q.bias`, ..., `blk.N.ffn_down.bias`):
  llama.cpp's "llama" loads all seven when present and adds each after its matmul (q and k before the rotation,
  so their biases take the q and k rows' permutation);
- the tokenizer as GGUF's "gpt2" byte-level BPE: tokens in id order, their types (control for specials), the
  merges, bos/eos, and no bos added (Deriv's tokenizer adds none).

f16 stores the matrices in half precision; q8_0 in llama.cpp's 8-bit blocks of 32 (gguf.quants), so every matrix
row must be a multiple of 32 wide; norms and biases stay float32 in all three. Written beside FILE and renamed into
place.

Needs the `runtimes` extra (`pip install deriv-lm[runtimes]`: gguf). Running the file needs llama.cpp, e.g.
llama-cpp-python.
"""

from __future__ import annotations

import json
import os

import numpy as np

from ..errors import MissingFile, UsageError
from ..folder.load import load_weights
from ..modeling_deriv import DerivForCausalLM
from . import llama
from .folders import model_type, vocabulary_rows


OUTTYPES = ("f32", "f16", "q8_0")

# Llama's name in block i -> GGUF's (the norms hold `.weight`, the projections `.weight` and, with bias=True, `.bias`)
_BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def gguf_names(num_layers: int, tied: bool, bias: bool = False) -> dict[str, str]:
    """Every `LlamaForCausalLM` tensor name -> its GGUF name."""
    names = dict(_TOP_NAMES)
    if not tied:
        names["lm_head.weight"] = "output.weight"
    for i in range(num_layers):
        for hf, gg in _BLOCK_NAMES.items():
            kinds = ("weight", "bias") if bias and not hf.endswith("layernorm") else ("weight",)
            names.update({f"model.layers.{i}.{hf}.{kind}": f"blk.{i}.{gg}.{kind}" for kind in kinds})
    return names


def interleaved(weight: np.ndarray, heads: int) -> np.ndarray:
    """q or k rows (a weight's, or a bias's entries) from the "half" rotary layout to llama.cpp's interleaved one:
    within each head, row j of the first half and row j of the second become rows 2j and 2j+1 (llama.cpp's
    `LlamaModel.permute`)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def llama_shaped(folder: str | os.PathLike):
    """The folder's DerivForCausalLM and its LlamaConfig; a folder of another shape is refused, naming why."""
    kind = model_type(folder)
    if kind != "deriv":
        raise UsageError(f"{folder} is a {kind!r} model; deriv export --to gguf writes Llama-shaped Deriv decoders.")
    _tokenizer(folder)  # refused before the weights are read
    model = load_weights(DerivForCausalLM, folder).eval()
    config = llama.llama_config(model.config)  # names the switches that are off
    llama.refuse_other_activations(folder, model.config.hidden_act, "llama.cpp")
    return model, config


def _tokenizer(folder: str | os.PathLike) -> dict:
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        raise MissingFile(f"{folder} has no tokenizer.json; deriv export --to gguf writes a byte-level BPE tokenizer.")
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    if spec.get("model", {}).get("type") != "BPE" or (spec.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
        raise UsageError(f"{path} is not a byte-level BPE tokenizer, the one GGUF's 'gpt2' tokenizer model runs.")
    return spec


def vocabulary(folder: str | os.PathLike, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """The tokens in id order (padded to the model's `vocab_size` with unused placeholders), their GGUF types,
    and the merges as "a b" lines."""
    from gguf import TokenType

    spec = _tokenizer(folder)
    by_id = {i: token for token, i in spec["model"]["vocab"].items()}
    special = {added["id"] for added in spec.get("added_tokens", []) if added.get("special")}
    by_id.update({added["id"]: added["content"] for added in spec.get("added_tokens", [])})
    if max(by_id) >= vocab_size:
        raise UsageError(f"{folder}: the tokenizer has ids up to {max(by_id)}, past the model's {vocab_size} rows.")
    tokens = [by_id.get(i, f"[UNUSED{i}]") for i in range(vocab_size)]
    types = [
        TokenType.CONTROL if i in special else TokenType.NORMAL if i in by_id else TokenType.UNUSED
        for i in range(vocab_size)
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    return tokens, [int(t) for t in types], merges


def _add_hyperparameters(writer, config, outtype: str) -> None:
    from gguf import LlamaFileType

    head_dim = config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    file_types = {"f32": LlamaFileType.ALL_F32, "f16": LlamaFileType.MOSTLY_F16, "q8_0": LlamaFileType.MOSTLY_Q8_0}
    writer.add_file_type(file_types[outtype])


def _add_tokenizer(writer, folder, model) -> None:
    tokens, types, merges = vocabulary(folder, model.config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    # subtle: "gpt-2" is GPT-2's split (the ByteLevel pre-tokenizer's regex, Deriv's); llama.cpp's "default" splits
    # punctuation runs and digit groups otherwise, and " (x)" or " 1234" would tokenize differently
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for setter, token_id in (
        (writer.add_bos_token_id, model.config.bos_token_id),
        # a list of end tokens (a chat model's) goes in as its first: GGUF has one eos id
        (writer.add_eos_token_id, _first(model.config.eos_token_id)),
        (writer.add_pad_token_id, model.config.pad_token_id),
    ):
        if token_id is not None:
            setter(token_id)
    writer.add_add_bos_token(False)  # subtle: Deriv's tokenizer adds no <bos>; llama.cpp would add one by default


def _first(token_id: int | list[int] | None) -> int | None:
    if isinstance(token_id, list):
        return token_id[0] if token_id else None
    return token_id


def _add_tensor(writer, name: str, array: np.ndarray, outtype: str) -> None:
    from gguf import GGMLQuantizationType, quants

    array = np.ascontiguousarray(array, dtype=np.float32)
    if array.ndim == 2 and outtype == "f16":
        writer.add_tensor(name, array.astype(np.float16))
    elif array.ndim == 2 and outtype == "q8_0":
        if array.shape[1] % 32:
            raise UsageError(f"--outtype q8_0 needs rows a multiple of 32 wide; {name} is {array.shape[1]} wide.")
        q8 = GGMLQuantizationType.Q8_0
        writer.add_tensor(name, quants.quantize(array, q8), raw_dtype=q8)
    else:
        writer.add_tensor(name, array)


def export_gguf(folder: str | os.PathLike, out: str | os.PathLike, outtype: str = "f32") -> str:
    """Write the Llama-shaped Deriv folder `folder` as the GGUF file `out` (which must not exist yet)."""
    from gguf import GGUFWriter

    if outtype not in OUTTYPES:
        raise UsageError(f"--outtype {outtype!r}: deriv export --to gguf writes {list(OUTTYPES)}.")
    if os.path.exists(out):
        raise UsageError(f"--out {out} already exists; choose a new file name.")
    model, config = llama_shaped(folder)
    tied, scale = config.tie_word_embeddings, llama.embed_scale(model.config)  # scaled: folded, the twin untied
    state = {k: v.float().numpy() for k, v in llama.to_llama(vocabulary_rows(model), tied, scale).items()}
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    partial = os.path.join(os.path.dirname(os.path.abspath(out)), f".{os.path.basename(out)}.partial-{os.getpid()}")
    try:
        writer = GGUFWriter(partial, "llama")
        writer.add_name(os.path.basename(os.path.abspath(folder)))
        _add_hyperparameters(writer, config, outtype)
        _add_tokenizer(writer, folder, model)
        for hf, gg in gguf_names(config.num_hidden_layers, tied, model.config.bias).items():
            array = state.pop(hf)
            projection = hf.rsplit(".", 2)[-2]
            if projection in heads:
                array = interleaved(array, heads[projection])
            _add_tensor(writer, gg, array, outtype)
        if state:
            raise ValueError(f"Tensors with no GGUF name: {sorted(state)}.")
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(partial, "rb") as f:
            os.fsync(f.fileno())
        os.replace(partial, out)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return str(out)
