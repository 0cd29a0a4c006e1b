"""Folders in, folders out: a native checkpoint imported as a Deriv folder, a Deriv folder exported as native.

Each direction loads with the library's own classes (never `trust_remote_code`) through `load_weights`, which
reads safetensors only (a pickled checkpoint is refused unopened) and refuses a checkpoint that lacks a tensor
of the model or holds one of another shape; it maps the weights through the tables in `gpt2.py`, `llama.py` and
`marian.py`, checks that every tensor found a place, and writes the new folder beside its target and renames it
in whole, with the source's tokenizer and generation config carried over unchanged. Export reads Deriv folders
only, and import the native types it knows (`IMPORTERS`), each as its config.json names it.
"""

from __future__ import annotations

import json
import os

import torch

from ..errors import MissingFile, UsageError, refused_as_usage
from ..folder.atomic import atomic_directory
from ..folder.inside import is_regular_inside
from ..folder.load import checked_files, load_weights, read_folder, read_json
from ..folder.remote_code import check_tokenizer_code
from ..folder.target import check_target
from ..modeling_deriv import DerivForCausalLM, DerivForConditionalGeneration
from . import gpt2, llama, marian


def _refuse_existing(out: str | os.PathLike) -> None:
    check_target(out, "--out", allow_existing=True)  # never /, ~, the working directory, a mount point, a link
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise FileExistsError(f"{out} already exists and is not empty; choose a new --out folder.")


def _load_exact(model: torch.nn.Module, state: dict[str, torch.Tensor], tied: set[str]) -> None:
    """Load `state` into `model`, and fail naming the tensors that found no place (or no value)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(f"The weights do not map onto the model: missing {missing}, unexpected {unexpected}.")
    model.tie_weights()


def source_name(source: str) -> str:
    """How the card and base_model name the source: a Hub id as given, a local folder by its name (never the path
    it had on this machine, as a fine-tuned folder's run.json names its base)."""
    return os.path.basename(os.path.abspath(source)) if os.path.isdir(source) else source


def source_license(source: str) -> str | None:
    """The license the source's own card (README.md) declares, or None when it has none or cannot be read."""
    from huggingface_hub import ModelCard

    path = os.path.join(source, "README.md") if os.path.isdir(source) else source
    if os.path.isdir(source) and not is_regular_inside(source, "README.md"):  # never a link out, never a FIFO
        return None
    try:
        license = ModelCard.load(path).data.license
    except Exception:  # subtle: the license is optional; a card that cannot be fetched or parsed leaves it unknown
        return None
    return license if isinstance(license, str) else None


def write_import_card(source: str, tmp: str, out: str | os.PathLike) -> None:
    """README.md for an imported folder (written in `tmp`, named after `out`): what it is (the source's weights,
    not a Deriv run) and whose license."""
    from ..hub_card.card import write_card

    name = os.path.basename(os.path.abspath(out))  # not yet a folder: the atomic write renames `tmp` to it
    write_card(tmp, name, source_license(source), imported_from=source_name(source))


def _tokenizer_config(folder: str) -> dict:
    if not os.path.lexists(os.path.join(folder, "tokenizer_config.json")):
        return {}
    return read_json(folder, "tokenizer_config.json")  # a regular file inside the folder, a JSON object


def _untrained_chat_template(source: str, template: str | None) -> bool:
    """Whether `template` is Deriv's default, which every tokenizer it trains carries, in a folder no chat
    fine-tune made: a template the model never learned."""
    from ..tokenization.bpe import CHAT_TEMPLATE

    if template != CHAT_TEMPLATE or not os.path.isfile(os.path.join(source, "run.json")):
        return False  # a template of the source's own (an import's source has no run.json)
    return read_folder(source).run.get("task") != "sft"


def native_tokenizer_names(source: str, target_dir: str) -> None:
    """The tokenizer files in `target_dir` as the target's own library names them: the class the source's
    tokenizer_config.json named (GPT2Tokenizer, MarianTokenizer), else `PreTrainedTokenizerFast` where
    transformers 5 wrote its generic `TokenizersBackend` (a name transformers 4 does not know; both read the
    other); and the source's chat template only, never Deriv's default from a run that did not train on chats.
    A kept template is also written into tokenizer_config.json, where transformers before 4.50 reads it."""
    config = _tokenizer_config(target_dir)
    named = _tokenizer_config(source).get("tokenizer_class") if os.path.isdir(source) else None
    if named and named != "TokenizersBackend":
        config["tokenizer_class"] = named
    elif config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    jinja = os.path.join(target_dir, "chat_template.jinja")
    template = config.get("chat_template")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            template = f.read()
    if template is not None and _untrained_chat_template(source, template):
        config.pop("chat_template", None)
        if os.path.isfile(jinja):
            os.remove(jinja)
    elif isinstance(template, str):
        config["chat_template"] = template
    with open(os.path.join(target_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _carry_tokenizer_and_generation(source: str, target_dir: str, model, padding_side: str | None = None) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    check_tokenizer_code(source, consent=None)  # a tokenizer of the folder's own code: refused, never asked about
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False)
    except (OSError, ValueError) as error:
        raise MissingFile(f"{source} has no tokenizer that transformers can load: {error}") from error
    # transformers builds one of special tokens alone from a folder without tokenizer files
    if not tokenizer.vocab_size or len(tokenizer) <= len(set(tokenizer.all_special_tokens)):
        raise MissingFile(
            f"{source} has no tokenizer (no tokenizer.json, vocab.json and merges.txt, or SentencePiece model): "
            "copy the checkpoint's tokenizer files into it, then import"
        )
    if padding_side:
        tokenizer.padding_side = padding_side
    tokenizer.save_pretrained(target_dir)
    native_tokenizer_names(source, target_dir)
    try:
        model.generation_config = GenerationConfig.from_pretrained(source)
    except OSError:  # no generation_config.json: the defaults that the model config implies
        model.generation_config = GenerationConfig.from_model_config(model.config)


_DERIV_TIED = {"lm_head.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"}


def _deriv_tied(config) -> set[str]:
    """The names that hold no tensor of their own: the output projection, and both sides' tables when shared."""
    return _DERIV_TIED - set(marian.embedding_names(config))


def vocabulary_rows(model: DerivForCausalLM) -> dict[str, torch.Tensor]:
    """The model's state dict with the embedding and the output projection cut to one row per id (`vocab_size`): the
    padding rows of a padded vocabulary (`pad_vocab_size_to_multiple_of`) are no token, and a native model, a
    runtime's file, has a row per token of its tokenizer."""
    state, vocab_size = model.state_dict(), model.config.vocab_size
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in state:
            state[name] = state[name][:vocab_size]
    return state


def gpt2_twin(native) -> DerivForCausalLM:
    """The `DerivForCausalLM` holding a `GPT2LMHeadModel`'s weights: the same function, Deriv's code."""
    config = gpt2.deriv_config(native.config)
    model = DerivForCausalLM(config)
    _load_exact(model, gpt2.to_deriv(native.state_dict(), config.num_hidden_layers), {"lm_head.weight"})
    return model


def marian_twin(native) -> DerivForConditionalGeneration:
    """The `DerivForConditionalGeneration` holding a `MarianMTModel`'s weights, its hidden basis reordered."""
    config = marian.deriv_config(native.config)
    model = DerivForConditionalGeneration(config)
    _load_exact(model, marian.to_deriv(native.state_dict(), config), _deriv_tied(config))
    return model


def import_gpt2(source: str, out: str | os.PathLike) -> str:
    """A `GPT2LMHeadModel` checkpoint (a folder, or a Hub id when online) as a `DerivForCausalLM` folder."""
    from transformers import GPT2LMHeadModel

    _refuse_existing(out)
    model = gpt2_twin(load_weights(GPT2LMHeadModel, source)).eval()
    with atomic_directory(out) as tmp:
        _carry_tokenizer_and_generation(source, tmp, model)
        model.save_pretrained(tmp)
        write_import_card(source, tmp, out)
    return str(out)


def native_gpt2(folder: str | os.PathLike):
    """The `GPT2LMHeadModel` a folder holds: itself (a GPT-2 folder) or the twin of a GPT-2-shaped Deriv one."""
    from transformers import GPT2LMHeadModel

    kind = model_type(folder)
    if kind == "gpt2":
        return load_weights(GPT2LMHeadModel, folder).eval()
    if kind != "deriv":
        raise UsageError(f"{folder} is a {kind!r} model, not a decoder with a GPT-2 twin (deriv or gpt2).")
    model = load_weights(DerivForCausalLM, folder)
    config = gpt2.gpt2_config(model.config)  # says which switches differ, where there is no twin
    native = GPT2LMHeadModel(config)
    _load_exact(native, gpt2.to_gpt2(vocabulary_rows(model), config.n_layer), set())
    return native.eval()


def export_gpt2(folder: str | os.PathLike, out: str | os.PathLike) -> str:
    """A Deriv decoder folder with GPT-2's switches as a `GPT2LMHeadModel` folder (no Deriv code in it)."""

    _refuse_existing(out)
    native = native_gpt2(folder)
    with atomic_directory(out) as tmp:
        _carry_tokenizer_and_generation(str(folder), tmp, native)
        native.save_pretrained(tmp)
    return str(out)


def llama_twin(native) -> DerivForCausalLM:
    """The `DerivForCausalLM` holding a `LlamaForCausalLM`'s weights: the same function, Deriv's code."""
    config = llama.deriv_config(native.config)
    model = DerivForCausalLM(config)
    tied = config.tie_word_embeddings
    _load_exact(model, llama.to_deriv(native.state_dict(), tied), {"lm_head.weight"} if tied else set())
    return model


def import_llama(source: str, out: str | os.PathLike) -> str:
    """A `LlamaForCausalLM` checkpoint (a folder, or a Hub id when online) as a `DerivForCausalLM` folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _refuse_existing(out)
    with refused_as_usage(f"{source}'s config.json"):  # a LlamaConfig that cannot exist, named in one line
        config = LlamaConfig.from_pretrained(source)
    llama.deriv_config(config)  # refuses before reading what may be gigabytes
    model = llama_twin(load_weights(LlamaForCausalLM, source)).eval()
    with atomic_directory(out) as tmp:
        _carry_tokenizer_and_generation(source, tmp, model)
        model.save_pretrained(tmp)
        write_import_card(source, tmp, out)
    return str(out)


# The Llama family's native classes: Llama, and Qwen3 (Llama with QK-norm), each with its config builder
LLAMA_FAMILY = {"llama": ("LlamaForCausalLM", llama.llama_config), "qwen3": ("Qwen3ForCausalLM", llama.qwen3_config)}


def native_llama(folder: str | os.PathLike, family: str = "llama"):
    """The `LlamaForCausalLM` (family "qwen3": `Qwen3ForCausalLM`) a folder holds: itself (a folder of that type) or
    the twin of a Deriv one with that family's switches."""
    import transformers

    class_name, config_of = LLAMA_FAMILY[family]
    native_class = getattr(transformers, class_name)
    kind = model_type(folder)
    if kind == family:
        return load_weights(native_class, folder).eval()
    if kind != "deriv":
        raise UsageError(f"{folder} is a {kind!r} model, not a decoder with a {class_name} twin (deriv or {family}).")
    model = load_weights(DerivForCausalLM, folder)
    config = config_of(model.config)  # says which switches differ, where there is no twin
    native = native_class(config)
    tied, scale = config.tie_word_embeddings, llama.embed_scale(model.config)  # a scaled folder: an untied twin
    _load_exact(native, llama.to_llama(vocabulary_rows(model), tied, scale), {"lm_head.weight"} if tied else set())
    return native.eval()


def export_llama(folder: str | os.PathLike, out: str | os.PathLike, family: str = "llama") -> str:
    """A Deriv decoder folder with Llama's switches as a `LlamaForCausalLM` folder (family "qwen3": with Qwen3's, as
    a `Qwen3ForCausalLM` folder), with no Deriv code in it."""
    _refuse_existing(out)
    native = native_llama(folder, family)
    with atomic_directory(out) as tmp:
        _carry_tokenizer_and_generation(str(folder), tmp, native)
        native.save_pretrained(tmp)
    return str(out)


def export_qwen3(folder: str | os.PathLike, out: str | os.PathLike) -> str:
    """A Deriv decoder folder with Qwen3's switches (Llama's, QK-norm, no bias) as a `Qwen3ForCausalLM` folder."""
    return export_llama(folder, out, family="qwen3")


_MARIAN_TABLES = {"model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight"}


def import_marian(source: str, out: str | os.PathLike) -> str:
    """A `MarianMTModel` checkpoint (OPUS-MT's, with one vocabulary or two) as a Deriv encoder-decoder."""
    from transformers import AutoTokenizer, MarianMTModel

    from ..modeling_deriv.pipeline_deriv import DerivTranslationPipeline

    _refuse_existing(out)
    model = marian_twin(load_weights(MarianMTModel, source)).eval()
    with atomic_directory(out) as tmp:
        _carry_tokenizer_and_generation(source, tmp, model)
        # as a trained translation folder: the pipeline rides along (custom_pipelines and its code), so
        # `pipeline(model=folder, trust_remote_code=True)` translates without this package
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        DerivTranslationPipeline(model=model, tokenizer=tokenizer).save_pretrained(tmp)
        write_import_card(source, tmp, out)
    return str(out)


def export_marian(folder: str | os.PathLike, out: str | os.PathLike) -> str:
    """A Deriv encoder-decoder folder as a `MarianMTModel` folder (its sinusoid tables are Marian's own)."""
    from transformers import MarianMTModel

    _refuse_existing(out)
    kind = model_type(folder)
    if kind != "deriv_seq2seq":
        raise UsageError(f"{folder} is a {kind!r} model, not an encoder-decoder with a Marian twin (deriv_seq2seq).")
    model = load_weights(DerivForConditionalGeneration, folder).eval()
    native = MarianMTModel(marian.marian_config(model.config)).eval()
    _load_exact(native, marian.to_marian(model.state_dict(), model.config), _MARIAN_TABLES)
    with atomic_directory(out) as tmp:
        # subtle: Marian numbers source positions from the first column, padding or not, while Deriv numbers
        # them from each row's first real token; the two agree when sources are padded on the right only.
        _carry_tokenizer_and_generation(str(folder), tmp, native, padding_side="right")
        native.save_pretrained(tmp)
    return str(out)


IMPORTERS = {"gpt2": import_gpt2, "llama": import_llama, "marian": import_marian}
EXPORTERS = {"gpt2": export_gpt2, "llama": export_llama, "qwen3": export_qwen3, "marian": export_marian}


def model_type(folder: str | os.PathLike) -> str | None:
    """The model type a folder's config.json names, read as written (no class is chosen, no code runs); a Hub
    id's through AutoConfig."""
    from transformers import AutoConfig

    if os.path.isdir(folder):  # every input folder passes here first: no link out, no FIFO among what is read
        checked_files(folder)
        return read_folder(folder).config.get("model_type")
    return AutoConfig.from_pretrained(folder).model_type


def import_model(source: str, out: str | os.PathLike) -> str:
    """Import whatever `source`'s config.json names, if Deriv knows that architecture."""
    kind = model_type(source)
    if kind not in IMPORTERS:
        raise UsageError(f"{source} is a {kind!r} model; deriv import reads {sorted(IMPORTERS)}.")
    return IMPORTERS[kind](source, out)
