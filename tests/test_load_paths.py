"""Loading never unpickles and never invents weights: every command that opens a model folder, against a table
of hostile folders.

The bases are a tiny native GPT-2 and a tiny native Marian, built here (what `deriv import` reads), and their
imports: a GPT-2-shaped Deriv language model and a Marian-shaped Deriv translation model (which `deriv export`
writes back). Each is copied and spoiled one way: its weights only as a pickle (a benign one, and one whose
unpickling would write a marker file), a tensor missing, none of the model's tensors, a tensor of the wrong
shape, a tensor the model has no place for, a truncated safetensors file, a config of another model type, or
shards whose index names a pickle, a path or link out of the folder, leaves out a tensor a shard holds, and more.
Every command that loads that kind of folder must refuse each copy before doing anything else: exit status 2,
one `deriv: error:` line naming the problem and the file, folder or tensor, nothing logged beside it, no
traceback, no output, and no pickle ever opened. The unspoiled bases pass every command, so each refusal is
the spoiling's. The shard index's checks are also proven one at a time on bare shards (the last section).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from hostile import fifo_valve
from safetensors.torch import load_file, save_file

from deriv_lm.cli import main


DATA = Path(__file__).parent / "data"
PICKLE = "pytorch_model.bin"
PROGRESS = re.compile(r"\[\d\d:\d\d[<,]")  # tqdm's "[00:00<?, ...]": a bar that started before the refusal

try:  # imported here, outside any test's captured output: torchao prints its own lines as it first loads
    import torchao  # noqa: F401

    HAS_TORCHAO = True
except ImportError:
    HAS_TORCHAO = False
HAS_SERVE = all(importlib.util.find_spec(name) for name in ("fastapi", "uvicorn", "pydantic"))
HAS_LM_EVAL = importlib.util.find_spec("lm_eval") is not None


class _Planted:
    """Unpickling this opens `path` for writing: the stand-in for a checkpoint that runs code when loaded."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


# ---- how a folder is spoiled ---------------------------------------------------------------------------


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def _save(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _first_matrix(tensors: dict) -> str:
    """The first 2-D weight of the first block (a projection every model of the table has)."""
    return sorted(k for k, t in tensors.items() if t.dim() == 2 and re.search(r"\.0\.", k))[0]


def pickle_only(folder: Path, marker: Path) -> str:
    torch.save(_weights(folder), folder / PICKLE)  # what torch.save of a state dict writes: benign, but a pickle
    (folder / "model.safetensors").unlink()
    return PICKLE


def malicious_pickle(folder: Path, marker: Path) -> str:
    torch.save({"weight": _Planted(str(marker))}, folder / PICKLE)
    (folder / "model.safetensors").unlink()
    return PICKLE


def missing_one(folder: Path, marker: Path) -> str:
    tensors = _weights(folder)
    name = _first_matrix(tensors)
    del tensors[name]
    _save(folder, tensors)
    return name


def none_of_its_tensors(folder: Path, marker: Path) -> str:
    _save(folder, {"unrelated.weight": torch.zeros(4, 4)})
    return "missing"


def wrong_shape(folder: Path, marker: Path) -> str:
    tensors = _weights(folder)
    name = _first_matrix(tensors)
    tensors[name] = tensors[name][:-1].clone()  # one row short
    _save(folder, tensors)
    return name


def extra_tensor(folder: Path, marker: Path) -> str:
    """Every tensor the model needs, and one it has no place for: weights and config of different models."""
    _save(folder, {**_weights(folder), "stray.weight": torch.zeros(4, 4)})
    return "stray.weight"


def truncated(folder: Path, marker: Path) -> str:
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    return "model.safetensors"


# A sharded folder: model.safetensors.index.json and two shards instead of model.safetensors, then one entry of
# the index (or one shard) made hostile. transformers would load whatever file the index names.
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _shard(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, str], str]:
    """Split the folder's weights into two shards and an index; (tensors, weight map, the first matrix)."""
    tensors = _weights(folder)
    names = sorted(tensors)
    weight_map = {name: SHARDS[i % 2] for i, name in enumerate(names)}
    for shard in SHARDS:
        part = {k: v.contiguous() for k, v in tensors.items() if weight_map[k] == shard}
        save_file(part, folder / shard, metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    return tensors, weight_map, _first_matrix(tensors)


def _write_index(folder: Path, weight_map: dict[str, str]) -> None:
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def index_names_a_pickle(folder: Path, marker: Path) -> str:
    tensors, weight_map, first = _shard(folder)
    torch.save({first: _Planted(str(marker))}, folder / "weights.bin")  # unpickled, it would write the marker
    _write_index(folder, {**weight_map, first: "weights.bin"})
    return "'weights.bin', which is not a safetensors file"


def _elsewhere(folder: Path, tensors: dict, first: str) -> Path:
    """A safetensors file outside the folder holding the tensor the index will point to."""
    other = folder.parent / f"{folder.name}-elsewhere"
    other.mkdir()
    save_file({first: tensors[first].contiguous()}, other / "model.safetensors")
    return other / "model.safetensors"


def index_names_a_file_outside(folder: Path, marker: Path) -> str:
    tensors, weight_map, first = _shard(folder)
    _elsewhere(folder, tensors, first)
    _write_index(folder, {**weight_map, first: f"../{folder.name}-elsewhere/model.safetensors"})
    return "a path outside the folder"


def index_names_an_absolute_path(folder: Path, marker: Path) -> str:
    tensors, weight_map, first = _shard(folder)
    _write_index(folder, {**weight_map, first: str(_elsewhere(folder, tensors, first))})
    return "a path outside the folder"


def index_names_a_link_out(folder: Path, marker: Path) -> str:
    tensors, weight_map, first = _shard(folder)
    (folder / "linked.safetensors").symlink_to(_elsewhere(folder, tensors, first))
    _write_index(folder, {**weight_map, first: "linked.safetensors"})
    return "link that leads outside the folder"


def index_lacks_a_tensor(folder: Path, marker: Path) -> str:
    """The index's allow-list: a shard still holds the tensor, the index leaves it out (transformers would load it
    without a word). Found from the files, before any weight is loaded."""
    _, weight_map, first = _shard(folder)
    del weight_map[first]
    _write_index(folder, weight_map)
    return f"leaves out 1 tensor its shards hold: {first}"


def index_and_shard_lack_a_tensor(folder: Path, marker: Path) -> str:
    """The index and its shards agree, and both lack a tensor the model needs: `load_weights`' missing check."""
    tensors, weight_map, first = _shard(folder)
    shard = weight_map.pop(first)
    save_file({k: v.contiguous() for k, v in tensors.items() if weight_map.get(k) == shard}, folder / shard)
    _write_index(folder, weight_map)
    return first


def index_tensor_in_two_shards(folder: Path, marker: Path) -> str:
    tensors, weight_map, first = _shard(folder)
    other = SHARDS[1] if weight_map[first] == SHARDS[0] else SHARDS[0]
    part = {k: v.contiguous() for k, v in tensors.items() if weight_map[k] == other or k == first}
    save_file(part, folder / other)  # the same tensor, a second time, in the other shard
    _write_index(folder, weight_map)
    return f"{first} ({SHARDS[0]}, {SHARDS[1]})"


def index_without_metadata(folder: Path, marker: Path) -> str:
    _, weight_map, _ = _shard(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return 'no "metadata"'


def index_names_with_a_nul(folder: Path, marker: Path) -> str:
    _, weight_map, first = _shard(folder)
    _write_index(folder, {**weight_map, first: "model\x00.safetensors"})
    return "NUL"


def index_names_with_a_lone_surrogate(folder: Path, marker: Path) -> str:
    _, weight_map, first = _shard(folder)
    _write_index(folder, {**weight_map, first: "model-\ud800.safetensors"})  # json.dumps writes it as \ud800
    return "lone surrogate"


def index_nested_too_deeply(folder: Path, marker: Path) -> str:
    _shard(folder)
    deep = '{"a": ' * 100_000 + "1" + "}" * 100_000
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": ' + deep + "}")
    return "nested too deeply"


def index_is_a_fifo(folder: Path, marker: Path) -> str:
    _shard(folder)
    os.mkfifo(folder / "model.safetensors.index.json")  # opened, it would block every command for ever
    return "FIFO"


def index_is_a_link_out(folder: Path, marker: Path) -> str:
    _, weight_map, _ = _shard(folder)
    other = folder.parent / f"{folder.name}-index"
    other.mkdir()
    _write_index(other, weight_map)  # the right index, but a file of another folder
    (folder / "model.safetensors.index.json").symlink_to(other / "model.safetensors.index.json")
    return "link that leads outside the folder"


def model_type(kind: str):
    def spoil(folder: Path, marker: Path) -> str:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "model_type": kind}))
        return repr(kind)

    spoil.__name__ = f"type_{kind}"
    return spoil


# name -> spoiler; each returns a string the refusal must contain (the file, the tensor or the type)
SPOILS = {
    "pickle": pickle_only,
    "malicious-pickle": malicious_pickle,
    "missing-one": missing_one,
    "no-model-tensors": none_of_its_tensors,
    "wrong-shape": wrong_shape,
    "extra-tensor": extra_tensor,
    "truncated": truncated,
    "index-names-a-bin": index_names_a_pickle,
    "index-outside": index_names_a_file_outside,
    "index-absolute": index_names_an_absolute_path,
    "index-link-out": index_names_a_link_out,
    "index-lacks-a-tensor": index_lacks_a_tensor,
    "index-and-shard-lack-a-tensor": index_and_shard_lack_a_tensor,
    "index-tensor-twice": index_tensor_in_two_shards,
    "index-no-metadata": index_without_metadata,
    "index-nul": index_names_with_a_nul,
    "index-surrogate": index_names_with_a_lone_surrogate,
    "index-nested": index_nested_too_deeply,
    "index-fifo": index_is_a_fifo,
    "index-itself-a-link-out": index_is_a_link_out,
    "type-bert": model_type("bert"),
    "type-gpt2": model_type("gpt2"),
}
# the source `deriv import` reads is a GPT-2: a config saying GPT-2 is right for it, one saying Deriv is not
IMPORT_SPOILS = {**{k: v for k, v in SPOILS.items() if k != "type-gpt2"}, "type-deriv": model_type("deriv")}


# ---- the commands ----------------------------------------------------------------------------------------

# base folder -> the commands that load it, by name; {folder} is the (spoiled) folder, {out} (a path in the
# test's own empty folder) the output that must not appear
COMMANDS = {
    "lm": {
        "generate": ["generate", "{folder}", "the fox", "--max-new-tokens", "2", "--no-stream"],
        "chat": ["chat", "{folder}"],
        "eval": ["eval", "{folder}", "--files", "{text}", "--max-tokens", "20"],
        "eval-tasks": ["eval", "{folder}", "--tasks", "deriv_numbers", "--include-path", "{tasks}"],
        "attention": ["attention", "{folder}", "the fox", "--out", "{out}.png"],
        "quantize": ["quantize", "{folder}", "--out", "{out}"],
        "export-gpt2": ["export", "{folder}", "--to", "gpt2", "--out", "{out}"],
        "serve": ["serve", "{folder}", "--port", "{port}"],  # refused before it serves (`serve` is stubbed to fail)
        "train-sft": ["train", "sft", "--init-from", "{folder}", "--files", "{chats}", "--output-dir", "{out}"]
        + ["--context-length", "32", "--batch-size", "4", "--max-steps", "1", "--eval-every", "1"]
        + ["--samples", "0", "--no-progress", "--cpu"],
    },
    "mt": {
        "translate": ["translate", "{folder}", "the fox", "--max-new-tokens", "4"],
        "eval": ["eval", "{folder}", "--files", "{pairs}", "--max-pairs", "2", "--all-pairs", "--num-beams", "1"],
        "attention": ["attention", "{folder}", "the fox", "--target", "der fuchs", "--out", "{out}.png"],
        "quantize": ["quantize", "{folder}", "--out", "{out}"],
        "export-marian": ["export", "{folder}", "--to", "marian", "--out", "{out}"],
    },
    "gpt2": {"import": ["import", "{folder}", "--out", "{out}"]},
    "marian": {"import": ["import", "{folder}", "--out", "{out}"]},
}
NATIVE = ("gpt2", "marian")  # the sources `deriv import` reads; the other bases are Deriv folders
# The spoilings found only by loading the weights (the others are found from the folder's files and config): `deriv
# eval --tasks` finds them after lm-evaluation-harness has indexed its tasks, some seconds in. Their refusals name
# the tensor (all but "no-model-tensors", which names what is missing), not the folder.
NAME_THE_TENSOR = ("missing-one", "wrong-shape", "extra-tensor", "index-and-shard-lack-a-tensor")
LOADED_TO_FIND = (*NAME_THE_TENSOR, "no-model-tensors")


def cases():
    for base, commands in COMMANDS.items():
        for name, command in commands.items():
            for spoil in IMPORT_SPOILS if base in NATIVE else SPOILS:
                skip = name == "quantize" and not HAS_TORCHAO
                marks = [pytest.mark.skip(reason="quantize needs torchao")] if skip else []
                if name == "serve" and not HAS_SERVE:
                    marks = [pytest.mark.skip(reason="the serve extra is not installed")]
                if name == "eval-tasks" and not HAS_LM_EVAL:
                    marks = [pytest.mark.skip(reason="the eval extra (lm-evaluation-harness) is not installed")]
                elif name == "eval-tasks" and spoil in LOADED_TO_FIND:  # found once the harness has its tasks
                    marks = [pytest.mark.slow]
                yield pytest.param(base, spoil, command, id=f"{base}-{spoil}-{name}", marks=marks)


# ---- the folders -------------------------------------------------------------------------------------------


def tiny_marian(tokenizer):
    """A MarianMTModel of the tiny shape (one vocabulary, the tokenizer's), as OPUS-MT's are built."""
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(
        vocab_size=len(tokenizer),
        decoder_vocab_size=len(tokenizer),
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        forced_eos_token_id=None,
    )
    return MarianMTModel(config)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_tokenizer) -> dict[str, Path]:
    """The bases, each spoiled every way, as `{base}` and `{base}-{spoil}`; also the inputs the commands read.
    The Deriv bases are imports of the native ones, so that each exports back (`deriv export`)."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from deriv_lm.convert import import_model
    from deriv_lm.tokenization.bpe import CHAT_TEMPLATE

    root = tmp_path_factory.mktemp("load_paths")
    found: dict = {"root": root, "marker": root / "unpickled"}
    config = GPT2Config(
        vocab_size=len(tiny_tokenizer),
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=tiny_tokenizer.bos_token_id,
        eos_token_id=tiny_tokenizer.eos_token_id,
        pad_token_id=tiny_tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    for name, model in (("gpt2", GPT2LMHeadModel(config)), ("marian", tiny_marian(tiny_tokenizer))):
        model.save_pretrained(root / name)
        tiny_tokenizer.save_pretrained(root / name)
    import_model(str(root / "gpt2"), root / "lm")
    import_model(str(root / "marian"), root / "mt")
    chat_tokenizer = AutoTokenizer.from_pretrained(root / "lm")  # `deriv chat` needs a chat template
    chat_tokenizer.chat_template = CHAT_TEMPLATE
    chat_tokenizer.save_pretrained(root / "lm")
    for base in COMMANDS:
        found[base] = root / base
        for name, spoil in (IMPORT_SPOILS if base in NATIVE else SPOILS).items():
            folder = root / f"{base}-{name}"
            shutil.copytree(root / base, folder)
            found[f"{base}-{name}:expected"] = spoil(folder, found["marker"])
            found[f"{base}-{name}"] = folder

    (root / "text.txt").write_text("the quick brown fox jumps over the lazy dog.\n" * 5)
    (root / "pairs.tsv").write_text("the fox\tder fuchs\nthe dog\tder hund\n")
    chats = [
        {"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"{i}"}]}
        for i in range(12)
    ]
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    found.update(text=root / "text.txt", pairs=root / "pairs.tsv", chats=root / "chats.jsonl")
    assert not found["marker"].exists()
    return found


def argv_for(command: list[str], folder: Path, folders: dict, out: Path) -> list[str]:
    values = dict(folder=folder, out=out, text=folders["text"], pairs=folders["pairs"], chats=folders["chats"])
    values["tasks"] = DATA / "numbers_task"
    values["port"] = free_port()
    return [arg.format(**values) for arg in command]


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _would_serve(*args, **kwargs):
    raise AssertionError("deriv serve loaded the folder and was about to serve it")


def run(argv: list[str], capsys, monkeypatch) -> tuple[int, str, str]:
    """`deriv argv` in this process: (exit status, stdout, stderr). Standard input is empty (chat ends at once);
    `deriv serve` fails where it would start serving, so a folder it failed to refuse cannot hang the test."""
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    monkeypatch.setattr("deriv_lm.serve.serve", _would_serve)
    capsys.readouterr()
    try:
        status = main(argv)
    except SystemExit as stop:
        status = stop.code
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture
def library_log() -> list[logging.LogRecord]:
    """What transformers logs at WARNING and above during the test. Its handler writes to the stderr it found
    when it was first used, which `capsys` does not capture; on a terminal it would stand beside the error."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    library = logging.getLogger("transformers")
    library.addHandler(handler)
    yield records
    library.removeHandler(handler)


# ---- the tests -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("base, spoil, command", list(cases()))
def test_a_hostile_folder_is_refused_in_one_line_before_anything_is_written(
    base, spoil, command, folders, tmp_path, capsys, monkeypatch, library_log
):
    folder, out = folders[f"{base}-{spoil}"], tmp_path / "out"
    with fifo_valve(folder) as blocked:  # a command that opened the planted FIFO would wait for ever
        status, stdout, err = run(argv_for(command, folder, folders, out), capsys, monkeypatch)
    assert blocked == [], "the command blocked on a FIFO"
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and not PROGRESS.search(line)]
    assert status == 2, f"exit status {status!r}; stderr: {err[-3000:]}"
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("deriv: error: "), err[-3000:]
    assert [record.getMessage() for record in library_log] == []  # no LOAD REPORT beside the one line
    line = lines[0]
    assert folders[f"{base}-{spoil}:expected"] in line, line  # the file, the tensor or the type at fault
    if spoil not in NAME_THE_TENSOR:  # those name the tensor, not the file
        assert str(folder) in line, line
    if "pickle" in spoil:
        assert "save_pretrained" in line and "model.safetensors" in line, line  # how to convert it, and to what
    assert list(tmp_path.iterdir()) == [], "an output was written"
    assert not folders["marker"].exists(), "a pickle was unpickled"
    if command[0] == "train":
        assert stdout == "", "the run started before the --init-from folder was refused"


UNSPOILED = [  # fine-tuning from a sound folder is tests/test_sft.py's (and takes seconds), as the harness's run
    pytest.param(base, name, id=f"{base}-{name}", marks=[pytest.mark.slow] if name == "eval-tasks" else [])
    for base, commands in COMMANDS.items()
    for name in commands
    if name not in ("train-sft", "serve")  # serving: tests/test_serve.py
    and (name != "quantize" or HAS_TORCHAO)
    and (name != "eval-tasks" or HAS_LM_EVAL)
]


@pytest.mark.parametrize("base, name", UNSPOILED)
def test_the_unspoiled_folders_pass_every_command(base, name, folders, tmp_path, capsys, monkeypatch):
    command = COMMANDS[base][name]
    status, _, err = run(argv_for(command, folders[base], folders, tmp_path / "out"), capsys, monkeypatch)
    assert status == 0, err[-3000:]


def test_derivs_model_types_are_its_config_classes():
    from deriv_lm import DerivConfig, DerivSeq2SeqConfig
    from deriv_lm.folder.load import DERIV_MODEL_TYPES

    assert DERIV_MODEL_TYPES == (DerivConfig.model_type, DerivSeq2SeqConfig.model_type)


@pytest.mark.parametrize("spoil", [*SPOILS, "translation"])
def test_the_servers_call_refuses_each_hostile_folder_with_one_message(spoil, folders):
    """`deriv serve` opens its folder with `load_folder(folder, seq2seq=False)`: a language model of Deriv's, or
    FileNotFoundError / ValueError with one line, as for the commands above."""
    from deriv_lm.folder.load import load_folder

    folder = folders["mt"] if spoil == "translation" else folders[f"lm-{spoil}"]
    with pytest.raises((ValueError, FileNotFoundError)) as refused, fifo_valve(folder) as blocked:
        load_folder(folder, seq2seq=False)
    assert blocked == []
    message = str(refused.value)
    assert "\n" not in message and str(folder) in message
    assert ("translation model" if spoil == "translation" else folders[f"lm-{spoil}:expected"]) in message
    assert not folders["marker"].exists()


def test_consent_runs_a_foreign_type_but_never_a_pickle_nor_incomplete_weights(folders):
    """--trust-remote-code (the user's consent to run another type's code) lets a native GPT-2 folder through
    `load_folder`; its weights are still read from safetensors only, and whole."""
    from transformers import GPT2LMHeadModel

    from deriv_lm.folder.load import load_folder

    assert isinstance(load_folder(folders["gpt2"], trust_remote_code=True).model, GPT2LMHeadModel)
    for spoil in ("malicious-pickle", "missing-one", "wrong-shape", "truncated"):
        with pytest.raises(ValueError, match=re.escape(folders[f"gpt2-{spoil}:expected"])):
            load_folder(folders[f"gpt2-{spoil}"], trust_remote_code=True)
    assert not folders["marker"].exists()


def test_a_load_that_passes_keeps_the_librarys_log_and_a_refusal_leaves_no_filter_behind(folders):
    from transformers import AutoModelForCausalLM

    from deriv_lm.folder.load import load_weights

    modeling = logging.getLogger("transformers.modeling_utils")
    with pytest.raises(ValueError):
        load_weights(AutoModelForCausalLM, folders["lm-missing-one"])
    assert modeling.filters == []
    assert load_weights(AutoModelForCausalLM, folders["lm"]).config.model_type == "deriv"
    assert modeling.filters == []


# ---- the shard index, one check at a time -----------------------------------------------------------------------
# `check_shard_index` on a bare folder of two small shards (no model: the index's checks read files only). Each row
# plants one fault and names the words only its own check says, so deleting any one check fails its row: a later
# check would refuse the folder for another reason, or nothing would.

A, B = SHARDS
SOUND_MAP = {"a": A, "b": A, "c": B}


def _bare_shards(folder: Path, held: dict[str, tuple[str, ...]]) -> None:
    """Write shards A and B; `held` maps each shard to the tensors it holds."""
    for shard, names in held.items():
        save_file({name: torch.full((2,), float(i)) for i, name in enumerate(names)}, folder / shard)


def _index_text(folder: Path, text: str) -> None:
    (folder / "model.safetensors.index.json").write_text(text)


def _sound(folder: Path) -> None:
    _bare_shards(folder, {A: ("a", "b"), B: ("c",)})
    _write_index(folder, SOUND_MAP)


def unnamed(folder):  # shard A still holds b; the index leaves it out (and transformers would load it)
    _sound(folder)
    _write_index(folder, {"a": A, "c": B})
    return "UsageError", "leaves out 1 tensor its shards hold: b"


def misplaced(folder):  # the index puts c in A; it is in B
    _sound(folder)
    _write_index(folder, {**SOUND_MAP, "c": A})
    return "UsageError", "names 1 tensor where they are not: c (not in " + A


def in_two_shards(folder):
    _bare_shards(folder, {A: ("a", "b"), B: ("c", "a")})
    _write_index(folder, SOUND_MAP)
    return "UsageError", f"1 tensor in more than one shard: a ({A}, {B})"


def duplicate_key(folder):  # "a" twice, both times in A: the map alone would look sound
    _sound(folder)
    _index_text(folder, f'{{"metadata": {{}}, "weight_map": {{"a": "{A}", "a": "{A}", "b": "{A}", "c": "{B}"}}}}')
    return "UsageError", "names 1 tensor more than once: a"


def not_json(folder):
    _sound(folder)
    _index_text(folder, '{"metadata": {}, "weight_map": ')
    return "UsageError", "is not valid JSON"


def not_an_object(folder):
    _sound(folder)
    _index_text(folder, json.dumps([SOUND_MAP]))
    return "UsageError", "should hold a JSON object"


def no_weight_map(folder):
    _sound(folder)
    _index_text(folder, json.dumps({"metadata": {}}))
    return "UsageError", "has no weight_map"


def weight_map_a_list(folder):
    _sound(folder)
    _index_text(folder, json.dumps({"metadata": {}, "weight_map": list(SOUND_MAP)}))
    return "UsageError", "has no weight_map"


def weight_map_empty(folder):  # with the shards' tensors nowhere in it, a load would find none of them
    _sound(folder)
    _write_index(folder, {})
    return "UsageError", "has no weight_map"


def no_metadata(folder):
    _sound(folder)
    _index_text(folder, json.dumps({"weight_map": SOUND_MAP}))
    return "UsageError", 'has no "metadata" object'


def no_shard_name(folder):
    _sound(folder)
    _write_index(folder, {**SOUND_MAP, "c": None})
    return "UsageError", "'c' names no shard file"


def shard_missing(folder):
    _sound(folder)
    (folder / B).unlink()
    return "MissingFile", f"'c' is in '{B}', which is not there"


def shard_not_whole(folder):
    _sound(folder)
    (folder / B).write_bytes((folder / B).read_bytes()[:-3])
    return "UsageError", f"{B}: not a whole safetensors file"


def shard_a_pickle_name(folder):
    _sound(folder)
    (folder / "c.bin").write_bytes(b"")
    _write_index(folder, {**SOUND_MAP, "c": "c.bin"})
    return "UsageError", "'c' is in 'c.bin', which is not a safetensors file"


def shard_outside(folder):
    _sound(folder)
    _write_index(folder, {**SOUND_MAP, "c": f"../{folder.name}/{B}"})  # the same file, by a path that leaves
    return "UsageError", "a path outside the folder"


INDEX_FAULTS = [unnamed, misplaced, in_two_shards, duplicate_key, not_json, not_an_object, no_weight_map]
INDEX_FAULTS += [weight_map_a_list, weight_map_empty, no_metadata, no_shard_name, shard_missing, shard_not_whole]
INDEX_FAULTS += [shard_a_pickle_name, shard_outside]


def test_a_sound_shard_index_passes_and_gives_its_map(tmp_path):
    from deriv_lm.folder.load import check_shard_index

    _sound(tmp_path)
    assert check_shard_index(tmp_path) == SOUND_MAP


@pytest.mark.parametrize("fault", INDEX_FAULTS, ids=lambda fault: fault.__name__.replace("_", "-"))
def test_each_check_of_the_shard_index_refuses_its_own_fault_by_name(fault, tmp_path):
    """One UsageError (of the class the fault calls for), one line, naming the index or the shard at fault and
    the tensor or field: the words only the check for this fault says."""
    from deriv_lm import errors
    from deriv_lm.folder.load import check_shard_index

    kind, words = fault(tmp_path)
    with pytest.raises(errors.UsageError) as refused:
        check_shard_index(tmp_path)
    message = str(refused.value)
    assert type(refused.value) is getattr(errors, kind), f"{type(refused.value).__name__}: {message}"
    assert words in message and "\n" not in message, message
    assert str(tmp_path) in message, message  # the index's path (or the shard's)
