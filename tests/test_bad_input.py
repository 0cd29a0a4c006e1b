"""Every `deriv` command against a table of bad input: files, numbers, flags, folders and prompts.

For each case the command must exit with status 2 and print exactly one line on stderr, starting
`deriv: error:`, that names what is wrong (each row gives the piece its line must hold: the flag or field at
fault with the bad value or the range, or the file or folder, so that a refusal for another reason fails the row);
no traceback; and no folder it was pointed at (the trained folders, the tokenizer) may change, nor may an output
folder be left behind. The commands run in this process (`deriv_lm.cli.main`), so a case that ends in an
unexpected exception fails with its traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys

import pytest
import torch

from deriv_lm.cli import main


# ---- the inputs the table points at ----------------------------------------------------------------

TINY_LM = ["--vocab-size", "300", "--context-length", "32", "--hidden-size", "32", "--num-hidden-layers", "1"]
TINY_LM += ["--num-attention-heads", "2", "--intermediate-size", "64", "--batch-size", "4", "--max-steps", "2"]
TINY_LM += ["--warmup-steps", "1", "--eval-every", "2", "--eval-batches", "1", "--save-every", "2", "--samples", "1"]
TINY_LM += ["--num-proc", "1", "--no-progress", "--cpu"]
TINY_MT = ["--vocab-size", "300", "--context-length", "24", "--hidden-size", "32", "--encoder-layers", "1"]
TINY_MT += ["--decoder-layers", "1", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
TINY_MT += ["--intermediate-size", "64", "--batch-size", "8", "--max-steps", "2"]
TINY_MT += ["--warmup-steps", "1", "--eval-every", "2", "--save-every", "2", "--num-beams", "2", "--samples", "1"]
TINY_MT += ["--no-progress", "--cpu"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    """Good folders (a language model, a translation model, a tokenizer) and bad files, by placeholder name."""
    from deriv_lm.data import default_corpus

    root = tmp_path_factory.mktemp("bad_input")
    p = {"tmp": str(root)}

    corpus = root / "corpus.jsonl"
    with open(corpus, "w") as f:
        for i, doc in enumerate(default_corpus()):
            if i >= 40:
                break
            f.write(json.dumps({"text": doc}) + "\n")
    p["corpus"] = str(corpus)
    pairs = root / "pairs.tsv"
    pairs.write_text("".join(f"open file {n}\töffne Datei {n}\n" for n in range(80)), encoding="utf-8")
    p["pairs"] = str(pairs)

    common = ["--cache-dir", str(root / "cache")]
    assert main(["train", "lm", "--files", p["corpus"], "--output-dir", str(root / "lm"), *common, *TINY_LM]) == 0
    assert main(["train", "translation", "--files", p["pairs"], "--output-dir", str(root / "mt"), *TINY_MT]) == 0
    assert main(["tokenizer", "train", "--files", p["corpus"], "--out", str(root / "tok"), "--vocab-size", "300"]) == 0
    p.update(lm=str(root / "lm"), mt=str(root / "mt"), tok=str(root / "tok"))

    def write(name: str, content: str | bytes) -> str:
        path = root / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
        return str(path)

    p["empty"] = write("empty.txt", "")
    p["blank"] = write("blank.txt", " \n\n\t\n")
    p["latin1"] = write("latin1.txt", "Grüße aus Köln\n".encode("latin-1"))
    p["latin1_tsv"] = write("latin1.tsv", "hello\tGrüße\n".encode("latin-1") * 20)
    p["nocol"] = write("nocol.jsonl", "".join(json.dumps({"body": f"text {i}"}) + "\n" for i in range(20)))
    p["badjson"] = write("bad.jsonl", '{"text": "ok"}\n{"text": \n')
    p["onecol"] = write("onecol.tsv", "".join(f"no tab here {i}\n" for i in range(20)))
    p["empty_tsv"] = write("empty.tsv", "")
    p["nocol_csv"] = write("nocol.csv", "a,b\n1,2\n")
    p["missing"] = str(root / "no-such-file.txt")
    p["missing_dir"] = str(root / "no-such-folder")
    p["a_file"] = write("a-file.txt", "not a folder\n")
    os.makedirs(root / "emptydir")
    p["emptydir"] = str(root / "emptydir")
    p["yaml_lr_word"] = write("lr_word.yaml", "learning_rate: fast\n")
    p["yaml_syntax"] = write("syntax.yaml", "max_steps: [1, 2\n")
    p["yaml_list"] = write("list.yaml", "- max_steps\n- 3\n")
    p["yaml_unknown"] = write("unknown.yaml", "max_stepz: 3\n")
    p["yaml_steps_word"] = write("steps_word.yaml", "max_steps: many\n")
    p["yaml_bool_word"] = write("bool_word.yaml", "pre_norm: maybe\n")
    p["yaml_float_steps"] = write("float_steps.yaml", "max_steps: 2.5\n")
    p["json_bad"] = write("bad.json", "{max_steps: 3}")
    p["yaml_missing"] = str(root / "no-such-config.yaml")

    # broken copies of the language model folder
    def broken(name: str, source: str, edit) -> str:
        target = root / name
        shutil.copytree(source, target)
        edit(target)
        return str(target)

    p["lm_bad_config"] = broken("lm_bad_config", p["lm"], lambda t: (t / "config.json").write_text("{not json"))
    p["lm_alien_type"] = broken(
        "lm_alien_type",
        p["lm"],
        lambda t: (t / "config.json").write_text(json.dumps({"model_type": "not_deriv_at_all"})),
    )

    def truncate(t):
        weights = t / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-100])

    p["lm_truncated"] = broken("lm_truncated", p["lm"], truncate)
    p["lm_no_weights"] = broken("lm_no_weights", p["lm"], lambda t: (t / "model.safetensors").unlink())
    p["lm_bad_tokenizer"] = broken("lm_bad_tokenizer", p["lm"], lambda t: (t / "tokenizer.json").write_text("[]"))
    # a chat template that reaches for Python's internals: jinja's sandbox stops it, the commands must say so.
    # subtle: it marks the assistant's messages ({% generation %}): without the marks `train sft` refuses the
    # template for lacking them, before rendering it, and never reaches the sandbox
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}{% for m in messages %}"
    escape += "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    escape += "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    p["lm_escaping_template"] = broken(
        "lm_escaping_template", p["lm"], lambda t: (t / "chat_template.jinja").write_text(escape)
    )
    chats = [{"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": str(i)}]}]
    p["chats"] = write("chats.jsonl", "".join(json.dumps(c) + "\n" for c in chats * 12))
    p["mt_no_record"] = broken("mt_no_record", p["mt"], lambda t: (t / "run.json").unlink())
    p["lm_empty_metrics"] = broken("lm_empty_metrics", p["lm"], lambda t: (t / "metrics.jsonl").write_text(""))
    p["lm_torn_metrics"] = broken(
        "lm_torn_metrics", p["lm"], lambda t: (t / "metrics.jsonl").write_text('{"step": 1\n{"step": 2}\n')
    )
    p["lm_binary_config"] = broken(
        "lm_binary_config", p["lm"], lambda t: (t / "config.json").write_bytes(bytes(range(256)) * 4)
    )
    p["long_prompt"] = "word " * 200  # far past the 32-token context
    p["marian"] = str(marian_with_sentencepiece(root / "marian"))
    p["gpt2_odd_heads"], p["gpt2_no_tokenizer"] = gpt2_sources(root)
    return p


def gpt2_sources(root):
    """Two GPT-2 checkpoints `deriv import` must refuse: one whose n_embd (30) is not a multiple of its n_head (4),
    one without tokenizer files (transformers would hand back an empty vocabulary)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    good = root / "gpt2_no_tokenizer"
    GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=32, n_layer=1, n_head=4, n_positions=32)).save_pretrained(good)
    odd = root / "gpt2_odd_heads"
    shutil.copytree(good, odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "n_embd": 30}))
    return str(odd), str(good)


def marian_with_sentencepiece(folder):
    """A tiny OPUS-MT-shaped checkpoint whose tokenizer is SentencePiece's (MarianTokenizer): the marian extra's."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    torch.manual_seed(0)
    shape = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2)
    shape.update(encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32)
    config = MarianConfig(vocab_size=64, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0, **shape)
    MarianMTModel(config).save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "MarianTokenizer"}))
    (folder / "vocab.json").write_text(json.dumps({"<pad>": 0, "<unk>": 1, "</s>": 2}))
    for name in ("source.spm", "target.spm"):
        (folder / name).write_bytes(b"not read: the tokenizer class needs SentencePiece first")
    return folder


# ---- the table ---------------------------------------------------------------------------------------
#
# Each row is (the command line, what its one line must say): the flag or field at fault as the message spells it,
# with the bad value or the allowed range where the message gives them, or the file or folder at fault
# ({placeholders} as in the command line). A refusal for another reason (a missing file, a missing extra, a flag
# the command does not know) does not say it, and fails the row.

OUT = "{tmp}/out"  # every command that writes is pointed here; it must not exist afterwards
UNKNOWN = "unrecognized arguments: "  # argparse's line for a flag the command does not have

TOKENIZER_TRAIN = [
    (["--files", "{missing}"], "No such file or folder: {missing}"),
    (["--files", "{empty}"], "The corpus is empty ({empty}: no document has any text)"),
    (["--files", "{blank}"], "The corpus is empty ({blank}: no document has any text)"),
    (["--files", "{latin1}"], "{latin1}: not valid UTF-8 at byte 2"),
    (["--files", "{emptydir}"], "No .txt/.jsonl/.json/.csv/.parquet files found in {emptydir}"),
    (["--files", "{nocol}"], "{nocol}: no column 'text'; the columns are ['body']"),
    (["--files", "{badjson}"], "{badjson}: cannot be read as json"),
    (["--files", "{nocol_csv}"], "{nocol_csv}: no column 'text'; the columns are ['a', 'b']"),
    (["--vocab-size", "100"], "argument --vocab-size: must be an integer >= 262 and <= 1048576, got '100'"),
    (["--vocab-size", "0"], "argument --vocab-size: must be an integer >= 262 and <= 1048576, got '0'"),
    (["--vocab-size", "-5"], "argument --vocab-size: must be an integer >= 262 and <= 1048576, got '-5'"),
    (
        ["--vocab-size", "1000000000"],
        "argument --vocab-size: must be an integer >= 262 and <= 1048576, got '1000000000'",
    ),
    (["--vocab-size", "abc"], "argument --vocab-size: must be an integer >= 262 and <= 1048576, got 'abc'"),
    (["--model-max-length", "0"], "argument --model-max-length: must be an integer >= 1, got '0'"),
    (["--model-max-length", "-1"], "argument --model-max-length: must be an integer >= 1, got '-1'"),
    (["--special-token", ""], "A special token must be a non-empty string, got ''"),
    (["--special-token", " "], "A special token must be a non-empty string, got ' '"),
    (["--dataset", "{missing_dir}"], "No such dataset folder: {missing_dir}"),
    (["--dataset", "{emptydir}"], "{emptydir}: datasets cannot read this folder"),
    (["--files", "{corpus}", "--dataset", "{emptydir}"], "argument --dataset: not allowed with argument --files"),
    (["--files", "{corpus}", "--text-column", "body"], "{corpus}: no column 'body'; the columns are ['text']"),
]
TOKENIZER_TRAIN_CASES = [(["tokenizer", "train", "--out", OUT, *case], names) for case, names in TOKENIZER_TRAIN]
TOKENIZER_TRAIN_CASES += [
    (["tokenizer", "train", "--files", "{corpus}"], "the following arguments are required: --out"),
    (["tokenizer", "train", "--files", "{corpus}", "--out", "{a_file}"], "--out {a_file} exists and is not a folder"),
]

TOKENIZER_USE_CASES = [
    (["tokenizer", "show", "{missing_dir}", "text"], "argument folder: No such folder: {missing_dir}"),
    (["tokenizer", "show", "{emptydir}", "text"], "{emptydir}: not a tokenizer folder"),
    (["tokenizer", "show", "{a_file}", "text"], "argument folder: No such folder: {a_file}"),
    (["tokenizer", "show", "{lm_bad_tokenizer}", "text"], "{lm_bad_tokenizer}: not a tokenizer folder"),
    (["tokenizer", "stats", "{missing_dir}"], "argument folder: No such folder: {missing_dir}"),
    (["tokenizer", "stats", "{tok}", "--sample-mb", "0"], "argument --sample-mb: must be a number > 0, got '0'"),
    (["tokenizer", "stats", "{tok}", "--sample-mb", "-1"], "argument --sample-mb: must be a number > 0, got '-1'"),
    (["tokenizer", "stats", "{tok}", "--sample-mb", "nan"], "argument --sample-mb: must be a number > 0, got 'nan'"),
    (["tokenizer", "stats", "{tok}", "--files", "{missing}"], "No such file or folder: {missing}"),
    (
        ["tokenizer", "stats", "{tok}", "--files", "{empty}"],
        "{empty}, split into documents at blank lines has no text",
    ),
    (["tokenizer", "stats", "{tok}", "--files", "{latin1}"], "{latin1}: not valid UTF-8 at byte 2"),
]

# Flags of the training tasks: (flags, what the line says, the one task that has the flag where only one does). The
# other task does not know such a flag, and its row says so: `deriv train translation --label-smoothing 1` checks the
# range, `deriv train lm --label-smoothing 1` is refused as an unknown flag (the line names it, not a range).
LM, MT = "lm", "translation"
TRAIN_FLAGS = [
    (["--max-grad-norm", "-1"], "`max_grad_norm` must be a number > 0, got -1.0", None),
    (["--max-grad-norm", "0"], "`max_grad_norm` must be a number > 0, got 0.0", None),
    (["--max-grad-norm", "nan"], "`max_grad_norm` must be a number > 0, got nan", None),
    (["--min-lr-ratio", "-0.1"], "`min_lr_ratio` must be a number >= 0 and <= 1, got -0.1", None),
    (["--min-lr-ratio", "1.5"], "`min_lr_ratio` must be a number >= 0 and <= 1, got 1.5", None),
    (["--weight-decay", "-0.1"], "`weight_decay` must be a number >= 0, got -0.1", None),
    (["--warmup-steps", "-1"], "`warmup_steps` must be an integer >= 0, got -1", None),
    (["--learning-rate", "0"], "`learning_rate` must be a number > 0, got 0.0", None),
    (["--learning-rate", "-1"], "`learning_rate` must be a number > 0, got -1.0", None),
    (["--learning-rate", "nan"], "`learning_rate` must be a number > 0, got nan", None),
    (["--learning-rate", "inf"], "`learning_rate` must be a number > 0, got inf", None),
    (["--dropout", "1.0"], "`dropout` must be a number >= 0 and < 1, got 1.0", None),
    (["--dropout", "-0.1"], "`dropout` must be a number >= 0 and < 1, got -0.1", None),
    (["--adam-beta1", "1.0"], "`adam_beta1` must be a number >= 0 and < 1, got 1.0", None),
    (["--adam-beta2", "-0.1"], "`adam_beta2` must be a number >= 0 and < 1, got -0.1", None),
    (["--batch-size", "0"], "`batch_size` must be an integer >= 1, got 0", None),
    (["--max-steps", "0"], "`max_steps` must be an integer >= 1, got 0", None),
    (["--context-length", "0"], "`max_position_embeddings` must be an integer >= 1, got 0", None),
    (
        ["--num-attention-heads", "4", "--hidden-size", "30"],
        "`hidden_size` (30) must be divisible by `num_attention_heads` (4)",
        LM,
    ),
    (["--num-attention-heads", "0"], "`num_attention_heads` must be an integer >= 1, got 0", LM),
    (["--num-hidden-layers", "0"], "`num_hidden_layers` must be an integer >= 1, got 0", LM),
    (["--intermediate-size", "0"], "`intermediate_size` must be an integer >= 1, got 0", None),
    (["--vocab-size", "100"], "`vocab_size` must be an integer >= 262 and <= 1048576, got 100", None),
    (["--vocab-size", "1000000000"], "`vocab_size` must be an integer >= 262 and <= 1048576, got 1000000000", None),
    (["--validation-fraction", "0"], "`validation_fraction` must be a number > 0 and < 1, got 0.0", LM),
    (["--validation-fraction", "1"], "`validation_fraction` must be a number > 0 and < 1, got 1.0", LM),
    (["--label-smoothing", "1"], "`label_smoothing` must be a number >= 0 and < 1, got 1.0", MT),
    (["--label-smoothing", "-0.1"], "`label_smoothing` must be a number >= 0 and < 1, got -0.1", MT),
    (["--mixed-precision", "fp8"], "argument --mixed-precision/--mixed_precision: invalid choice: 'fp8'", None),
    (["--report-to", "wandb"], "`report_to` wandb: the wandb package is not installed", None),
    (["--lr-schedule", "linear"], "argument --lr-schedule/--lr_schedule: invalid choice: 'linear'", None),
    (["--optimizer", "sgd"], "argument --optimizer: invalid choice: 'sgd'", None),
    (["--muon-learning-rate", "0"], "`muon_learning_rate` must be a number > 0, got 0.0", None),
    (["--muon-learning-rate", "-1"], "`muon_learning_rate` must be a number > 0, got -1.0", None),
    (["--muon-momentum", "1"], "`muon_momentum` must be a number >= 0 and < 1, got 1.0", None),
    (["--decay-ratio", "0"], "`decay_ratio` must be a number > 0 and <= 1, got 0.0", None),
    (["--decay-ratio", "1.5"], "`decay_ratio` must be a number > 0 and <= 1, got 1.5", None),
    # the warmup and the decay are longer than the run
    (["--lr-schedule", "wsd", "--decay-ratio", "0.95"], "--decay-ratio 0.95 of --max-steps", None),
    (["--pad-vocab-size-to-multiple-of", "0"], "`pad_vocab_size_to_multiple_of` must be an integer >= 1, got 0", LM),
    (["--pad-vocab-multiple", "-64"], "`pad_vocab_size_to_multiple_of` must be an integer >= 1, got -64", LM),
    (
        ["--pad-vocab-multiple", "1.5"],
        "--pad-vocab-multiple/--pad_vocab_size_to_multiple_of/--pad_vocab_multiple: invalid int value: '1.5'",
        LM,
    ),
    (
        ["--loss-implementation", "fused"],
        "argument --loss-implementation/--loss_implementation: invalid choice: 'fused'",
        LM,
    ),
    (["--loss-chunk-size", "0"], "`loss_chunk_size` must be an integer >= 1, got 0", LM),
    (["--loss-chunk-size", "-1"], "`loss_chunk_size` must be an integer >= 1, got -1", LM),
    (["--hidden-act", "swishy"], "argument --hidden-act/--hidden_act: invalid choice: 'swishy'", None),
    (["--preset", "huge"], "Unknown preset 'huge'; choose one of", None),
    (["--seed", "-1"], "`seed` must be an integer >= 0 and <= 4294967295, got -1", None),
    (["--seed", "4294967296"], "`seed` must be an integer >= 0 and <= 4294967295, got 4294967296", None),
    (["--num-proc", "0"], "`num_proc` must be an integer >= 1, got 0", None),
    (["--eval-batches", "0"], "`eval_batches` must be an integer >= 1, got 0", LM),
    (["--keep-checkpoints", "0"], "`keep_checkpoints` must be an integer >= 1, got 0", None),
    (["--log-every", "0"], "`log_every` must be an integer >= 1, got 0", None),
    (["--eval-every", "0"], "`eval_every` must be an integer >= 1, got 0", None),
    (["--save-every", "-1"], "`save_every` must be an integer >= 1, got -1", None),
    (["--samples", "-1"], "`samples` must be an integer >= 0, got -1", None),
    (["--gradient-accumulation-steps", "0"], "`gradient_accumulation_steps` must be an integer >= 1, got 0", None),
    (["--num-beams", "0"], "`num_beams` must be an integer >= 1 and <= 64, got 0", MT),
    (["--num-beams", "100000"], "`num_beams` must be an integer >= 1 and <= 64, got 100000", MT),
    (["--encoder-layers", "0"], "`encoder_layers` must be an integer >= 1, got 0", MT),
    (["--decoder-layers", "-1"], "`decoder_layers` must be an integer >= 1, got -1", MT),
    (["--bleu-pairs", "0"], "`bleu_pairs` must be an integer >= 1, got 0", MT),
    (["--max-steps", "abc"], "argument --max-steps/--max_steps: invalid int value: 'abc'", None),
    (["--batch-size", "1.5"], "argument --batch-size/--batch_size: invalid int value: '1.5'", None),
    (["--no-such-flag"], UNKNOWN + "--no-such-flag", None),
    (["--config", "{yaml_missing}"], "No such config file: {yaml_missing}", None),
    (["--config", "{yaml_syntax}"], "{yaml_syntax}: not valid YAML", None),
    (["--config", "{yaml_list}"], "{yaml_list}: expected a mapping of argument names to values", None),
    (["--config", "{yaml_unknown}"], "{yaml_unknown}: unknown training arguments ['max_stepz']", None),
    (["--config", "{yaml_steps_word}"], "{yaml_steps_word}: `max_steps` must be an integer, got 'many'", None),
    (["--config", "{yaml_bool_word}"], "{yaml_bool_word}: `pre_norm` must be true or false, got 'maybe'", None),
    (["--config", "{yaml_lr_word}"], "{yaml_lr_word}: `learning_rate` must be a number, got 'fast'", None),
    (["--config", "{yaml_float_steps}"], "{yaml_float_steps}: `max_steps` must be an integer, got 2.5", None),
    (["--config", "{json_bad}"], "{json_bad}: not valid JSON", None),
    (["--tokenizer", "{missing_dir}"], "--tokenizer {missing_dir}: no such folder", None),
    (["--tokenizer", "{emptydir}"], "No tokenizer.json in {emptydir}", None),
    (["--dataset", "{missing_dir}"], "Pass either `files` or `dataset`, not both", None),  # beside the rows' --files
]


def train_rows(task: str, head: list[str]) -> list[tuple[list[str], str]]:
    """TRAIN_FLAGS for one task after `head`: a flag of the other task alone is refused as unknown, naming it."""
    return [
        ([*head, *flags], names if only in (None, task) else UNKNOWN + " ".join(flags[:2]))
        for flags, names, only in TRAIN_FLAGS
        if task == LM or flags[0] not in ("--files", "--max-steps")  # keep the table's size sensible
    ]


TRAIN_LM_CASES = train_rows(LM, ["train", "lm", "--files", "{corpus}", "--output-dir", OUT])
TRAIN_LM_CASES += [
    (["train", "lm", "--output-dir", OUT, "--files", name, *TINY_LM], names)
    for name, names in [
        ("{missing}", "No such file or folder: {missing}"),
        ("{empty}", "The corpus is empty ({empty}: no document has any text)"),
        ("{blank}", "The corpus is empty ({blank}: no document has any text)"),
        ("{latin1}", "{latin1}: not valid UTF-8 at byte 2"),
        ("{nocol}", "{nocol}: no column 'text'; the columns are ['body']"),
        ("{emptydir}", "No .txt/.jsonl/.json/.csv/.parquet files found in {emptydir}"),
        ("{badjson}", "{badjson}: cannot be read as json"),
    ]
]
TRAIN_LM_CASES += [
    (
        ["train", "lm", "--dataset", "{missing_dir}", "--output-dir", OUT, *TINY_LM],
        "No such dataset folder: {missing_dir}",
    ),
    (
        ["train", "lm", "--files", "{corpus}", "--output-dir", "{a_file}", *TINY_LM],
        "--output-dir {a_file} exists and is not a folder",
    ),
    (
        ["train", "lm", "--files", "{corpus}", "--max-documents", "0", "--output-dir", OUT],
        "`max_documents` must be an integer >= 1, got 0",
    ),
]
TRAIN_MT_CASES = train_rows(MT, ["train", "translation", "--files", "{pairs}", "--output-dir", OUT])
TRAIN_MT_CASES += [
    (["train", "translation", "--output-dir", OUT, "--files", name, *TINY_MT], names)
    for name, names in [
        ("{missing}", "No such file or folder: {missing}"),
        ("{empty_tsv}", "No pairs with text on both sides in local: 1 file(s) {empty_tsv}"),
        ("{onecol}", "{onecol}:1: expected 'source<TAB>target', found 1 tab-separated field(s)"),
        ("{latin1_tsv}", "{latin1_tsv}: not valid UTF-8 at byte 8"),
        ("{emptydir}", "{emptydir}: parallel data must be .tsv (source<TAB>target), .jsonl or .json"),
    ]
]
TRAIN_MT_CASES += [
    (
        ["train", "translation", "--dataset", "{missing_dir}", "--output-dir", OUT, *TINY_MT],
        "No such dataset folder: {missing_dir}",
    ),
]
# The speedrun's model switches (issue 48): the decoder's alone (the translation model has no such flag, nor relu2)
SPEEDRUN_MODEL_FLAGS = [
    (["--final-logit-softcapping", "0"], "`final_logit_softcapping` must be a number > 0, got 0.0"),
    (["--final-logit-softcapping", "-1"], "`final_logit_softcapping` must be a number > 0, got -1.0"),
    (["--final-logit-softcapping", "nan"], "`final_logit_softcapping` must be a number > 0, got nan"),
    (
        ["--final-logit-softcapping", "high"],
        "argument --final-logit-softcapping/--final_logit_softcapping: invalid float value: 'high'",
    ),
    (["--hidden-act", "relu3"], "argument --hidden-act/--hidden_act: invalid choice: 'relu3'"),
    (["--qk-norm", "maybe"], "argument --qk-norm/--qk_norm: Truthy value expected: got maybe"),
    (
        ["--no-tie-word-embeddings", "--tie-word-embeddings", "perhaps"],
        "argument --tie-word-embeddings/--tie_word_embeddings: Truthy value expected: got perhaps",
    ),
]
TRAIN_LM_CASES += [
    (["train", "lm", "--files", "{corpus}", "--output-dir", OUT, *flags], names)
    for flags, names in SPEEDRUN_MODEL_FLAGS
]
TRAIN_MT_CASES += [
    (["train", "translation", "--files", "{pairs}", "--output-dir", OUT, *flags], names)
    for flags, names in [
        (["--hidden-act", "relu2"], "argument --hidden-act/--hidden_act: invalid choice: 'relu2'"),
        (["--qk-norm"], UNKNOWN + "--qk-norm"),
        (["--final-logit-softcapping", "30"], UNKNOWN + "--final-logit-softcapping 30"),
    ]
]

GENERATE_CASES = [
    (["generate", "{missing_dir}", "hello"], "argument folder: {missing_dir}: no such model folder"),
    (["generate", "{emptydir}", "hello"], "argument folder: {emptydir} is not a model folder: it has no config.json"),
    (["generate", "{a_file}", "hello"], "argument folder: {a_file}: no such model folder"),
    (["generate", "{mt}", "hello"], "{mt} holds a translation model; this command needs a language model"),
    (["generate", "{lm_bad_config}", "hello"], "{lm_bad_config}/config.json is not valid JSON"),
    (["generate", "{lm_alien_type}", "hello"], "{lm_alien_type} holds a 'not_deriv_at_all' model, not a Deriv one"),
    (["generate", "{lm_truncated}", "hello"], "{lm_truncated}/model.safetensors: not a whole safetensors file"),
    (["generate", "{lm_no_weights}", "hello"], "{lm_no_weights} has no model.safetensors"),
    (
        ["generate", "{lm}", "hello", "--num-beams", "0"],
        "argument --num-beams: must be an integer >= 1 and <= 64, got '0'",
    ),
    (
        ["generate", "{lm}", "hello", "--num-beams", "-1"],
        "argument --num-beams: must be an integer >= 1 and <= 64, got '-1'",
    ),
    (
        ["generate", "{lm}", "hello", "--max-new-tokens", "0"],
        "argument --max-new-tokens: must be an integer >= 1, got '0'",
    ),
    (
        ["generate", "{lm}", "hello", "--max-new-tokens", "-5"],
        "argument --max-new-tokens: must be an integer >= 1, got '-5'",
    ),
    (["generate", "{lm}", "hello", "--temperature", "-1"], "argument --temperature: must be a number >= 0, got '-1'"),
    (
        ["generate", "{lm}", "hello", "--temperature", "nan"],
        "argument --temperature: must be a number >= 0, got 'nan'",
    ),
    (
        ["generate", "{lm}", "hello", "--temperature", "abc"],
        "argument --temperature: must be a number >= 0, got 'abc'",
    ),
    (["generate", "{lm}", "hello", "--top-k", "-1"], "argument --top-k: must be an integer >= 0, got '-1'"),
    (["generate", "{lm}", "hello", "--top-p", "0"], "argument --top-p: must be a number > 0 and <= 1, got '0'"),
    (["generate", "{lm}", "hello", "--top-p", "1.5"], "argument --top-p: must be a number > 0 and <= 1, got '1.5'"),
    (
        ["generate", "{lm}", "hello", "--repetition-penalty", "0"],
        "argument --repetition-penalty: must be a number > 0, got '0'",
    ),
    (
        ["generate", "{lm}", "hello", "--repetition-penalty", "-1"],
        "argument --repetition-penalty: must be a number > 0, got '-1'",
    ),
    (
        ["generate", "{lm}", "hello", "--presence-penalty", "nan"],
        "argument --presence-penalty: must be a number >= -2.0 and <= 2.0, got 'nan'",
    ),
    (
        ["generate", "{lm}", "hello", "--seed", "-1"],
        "argument --seed: must be an integer >= 0 and <= 4294967295, got '-1'",
    ),
    (
        ["generate", "{lm}", "hello", "--seed", "4294967296"],
        "argument --seed: must be an integer >= 0 and <= 4294967295, got '4294967296'",
    ),
    (
        ["generate", "{lm}", "hello", "--num-beams", "100000"],
        "argument --num-beams: must be an integer >= 1 and <= 64, got '100000'",
    ),
    (
        ["generate", "{lm}", "hello", "--num-beams", "65"],
        "argument --num-beams: must be an integer >= 1 and <= 64, got '65'",
    ),
    (
        ["generate", "{lm}", "{long_prompt}"],
        "The prompt is 800 tokens; the model reads at most 32 (max_position_embeddings)",
    ),
    (["generate", "{lm}"], "the following arguments are required: prompt"),
]
TRANSLATE_CASES = [
    (["translate", "{missing_dir}", "hello"], "argument folder: {missing_dir}: no such model folder"),
    (["translate", "{lm}", "hello"], "{lm} holds a language model; this command needs a translation model"),
    (["translate", "{emptydir}", "hello"], "argument folder: {emptydir} is not a model folder: it has no config.json"),
    (
        ["translate", "{mt}", "hello", "--num-beams", "0"],
        "argument --num-beams: must be an integer >= 1 and <= 64, got '0'",
    ),
    (
        ["translate", "{mt}", "hello", "--num-return-sequences", "0"],
        "argument --num-return-sequences: must be an integer >= 1 and <= 64, got '0'",
    ),
    (
        ["translate", "{mt}", "hello", "--num-beams", "100000"],
        "argument --num-beams: must be an integer >= 1 and <= 64, got '100000'",
    ),
    (
        ["translate", "{mt}", "hello", "--num-return-sequences", "100000"],
        "argument --num-return-sequences: must be an integer >= 1 and <= 64, got '100000'",
    ),
    (
        ["translate", "{mt}", "hello", "--num-return-sequences", "3", "--num-beams", "2"],
        "--num-return-sequences 3 needs at least as many beams (--num-beams 3), not 2",
    ),
    (
        ["translate", "{mt}", "hello", "--max-new-tokens", "0"],
        "argument --max-new-tokens: must be an integer >= 1, got '0'",
    ),
    (
        ["translate", "{mt}", "hello", "--length-penalty", "nan"],
        "argument --length-penalty: must be a number, got 'nan'",
    ),
    (["translate", "{mt}", ""], "Sentence 1 is empty: there is nothing to translate"),
    (["translate", "{mt}", "{long_prompt}"], "Sentence 1 is 1000 tokens; the model reads at most 24"),
]
EVAL_CASES = [
    (["eval", "{missing_dir}"], "argument folder: {missing_dir}: no such model folder"),
    (["eval", "{emptydir}"], "argument folder: {emptydir} is not a model folder: it has no config.json"),
    (["eval", "{lm}", "--files", "{corpus}", "--stride", "0"], "argument --stride: must be an integer >= 1, got '0'"),
    (
        ["eval", "{lm}", "--files", "{corpus}", "--stride", "-1"],
        "argument --stride: must be an integer >= 1, got '-1'",
    ),
    (
        ["eval", "{lm}", "--files", "{corpus}", "--stride", "1000"],
        "--stride 1000 is longer than the model's window of 32 tokens",
    ),
    (
        ["eval", "{lm}", "--files", "{corpus}", "--max-tokens", "0"],
        "argument --max-tokens: must be an integer >= 2, got '0'",
    ),
    (
        ["eval", "{lm}", "--files", "{corpus}", "--max-tokens", "1"],
        "argument --max-tokens: must be an integer >= 2, got '1'",
    ),
    (["eval", "{lm}", "--files", "{missing}"], "No such file or folder: {missing}"),
    (
        ["eval", "{lm}", "--files", "{empty}"],
        "{empty}, split into documents at blank lines (as given, not split) gives 0 token(s)",
    ),
    (["eval", "{lm}", "--files", "{latin1}"], "{latin1}: not valid UTF-8 at byte 2"),
    (["eval", "{lm}", "--files", "{nocol}"], "{nocol}: no column 'text'; the columns are ['body']"),
    (
        ["eval", "{mt}", "--files", "{pairs}", "--num-beams", "0"],
        "argument --num-beams: must be an integer >= 1 and <= 64, got '0'",
    ),
    (
        ["eval", "{mt}", "--files", "{pairs}", "--num-beams", "100000"],
        "argument --num-beams: must be an integer >= 1 and <= 64, got '100000'",
    ),
    (
        ["eval", "{mt}", "--files", "{pairs}", "--max-pairs", "0"],
        "argument --max-pairs: must be an integer >= 1, got '0'",
    ),
    (
        ["eval", "{mt}", "--files", "{onecol}"],
        "{onecol}:1: expected 'source<TAB>target', found 1 tab-separated field(s)",
    ),
    (["eval", "{mt}", "--files", "{missing}"], "No such file: {missing}"),
]
# `push` names the repository it would upload to; every row but the one without --repo-id gives one, so that the
# folder's fault is what the line names
HUB_CASES = [
    (["card", "{missing_dir}"], "argument folder: No such folder: {missing_dir}"),
    (["card", "{emptydir}"], "{emptydir} is not a model folder: it has no config.json"),
    (["card", "{a_file}"], "argument folder: No such folder: {a_file}"),
    (
        ["push", "{missing_dir}", "--dry-run", "--repo-id", "me/model"],
        "argument folder: No such folder: {missing_dir}",
    ),
    (
        ["push", "{emptydir}", "--dry-run", "--repo-id", "me/model"],
        "{emptydir} is not a model folder: it has no config.json",
    ),
    (["push", "{lm}", "--dry-run"], "the following arguments are required: --repo-id"),
    (
        ["push", "{lm_truncated}", "--dry-run", "--repo-id", "me/model"],
        "{lm_truncated}/model.safetensors: not a whole safetensors file",
    ),
    (
        ["push", "{lm}", "--dry-run", "--repo-id", "bad id!!"],
        "'bad id!!' is not a valid repo id (expected NAME or OWNER/NAME)",
    ),
    (
        ["push", "{lm}", "--dry-run", "--repo-id", "../../etc"],
        "'../../etc' is not a valid repo id (expected NAME or OWNER/NAME)",
    ),
    (["check", "{missing_dir}"], "argument folder: No such folder: {missing_dir}"),
    (["check", "{emptydir}"], "{emptydir} is not a model folder: it has no config.json"),
    (["check", "{lm_truncated}"], "{lm_truncated}/model.safetensors: not a whole safetensors file"),
    (["check", "{lm_no_weights}"], "{lm_no_weights}: model.safetensors is missing, so there is no model to check"),
]
VIZ_CASES = [
    (["attention", "{missing_dir}", "hello", "--out", OUT], "argument folder: {missing_dir}: no such model folder"),
    (
        ["attention", "{emptydir}", "hello", "--out", OUT],
        "argument folder: {emptydir} is not a model folder: it has no config.json",
    ),
    (
        ["attention", "{lm}", "hello", "--layers", "99", "--out", OUT],
        "layer 99 is out of range: the model has 1 layers (0 to 0)",
    ),
    (
        ["attention", "{lm}", "hello", "--heads", "99", "--out", OUT],
        "head 99 is out of range: the model has 2 heads (0 to 1)",
    ),
    (
        ["attention", "{lm}", "hello", "--layers", "-1", "--out", OUT],
        "argument --layers: must be an integer >= 0, got '-1'",
    ),
    (["attention", "{lm}", "", "--out", OUT], "The text is empty"),
    (["attention", "{lm}", "hello", "--kind", "bogus", "--out", OUT], "argument --kind: invalid choice: 'bogus'"),
    (["attention", "{lm}", "{long_prompt}", "--out", OUT], "The text is 800 tokens long; the model reads at most 32"),
    (
        ["attention", "{lm_alien_type}", "hello", "--out", OUT],
        "{lm_alien_type} holds a 'not_deriv_at_all' model, not a Deriv one",
    ),
    (
        ["picture", "positions", "--positions", "0", "--out", OUT],
        "argument --positions: must be an integer >= 1 and <= 4096, got '0'",
    ),
    (
        ["picture", "positions", "--dim", "0", "--out", OUT],
        "argument --dim: must be an integer >= 2 and <= 4096, got '0'",
    ),
    (
        ["picture", "positions", "--dim", "3", "--out", OUT],
        "--dim 3: the sinusoidal table pairs a sine and a cosine, so it must be even",
    ),
    (
        ["picture", "positions", "--positions", "1000000000", "--out", OUT],
        "argument --positions: must be an integer >= 1 and <= 4096, got '1000000000'",
    ),
    (
        ["picture", "positions", "--positions", "4097", "--out", OUT],
        "argument --positions: must be an integer >= 1 and <= 4096, got '4097'",
    ),
    (
        ["picture", "positions", "--dim", "1000000000", "--out", OUT],
        "argument --dim: must be an integer >= 2 and <= 4096, got '1000000000'",
    ),
    (["picture", "kv-memory", "--positions", "999", "--out", OUT], "--positions 999: past the models' --context 256"),
    (
        ["picture", "kv-memory", "--batches", "100000000", "--out", OUT],
        "--batches 100000000: the static KV cache at --context 256 would take",
    ),
    (
        ["picture", "kv-memory", "--context", "1000000000", "--positions", "16", "--out", OUT],
        "argument --context: must be an integer >= 2 and <= 131072, got '1000000000'",
    ),
    (["picture", "tokens", "{missing_dir}", "hello", "--out", OUT], "argument folder: No such folder: {missing_dir}"),
    (["picture", "tokens", "{tok}", "", "--out", OUT], "The text is empty"),
    (
        ["picture", "temperature", "{lm}", "hello", "--temperatures", "1.0", "--out", OUT],
        "--temperatures needs two or more values",
    ),
    (
        ["picture", "temperature", "{lm}", "hello", "--temperatures", "-1", "1", "--out", OUT],
        "argument --temperatures: must be a number > 0, got '-1'",
    ),
    (
        ["picture", "temperature", "{lm}", "hello", "--top-k", "-1", "--out", OUT],
        "argument --top-k: must be an integer >= 1, got '-1'",
    ),
    (
        ["picture", "temperature", "{lm}", "hello", "--top-p", "2", "--out", OUT],
        "argument --top-p: must be a number > 0 and <= 1, got '2'",
    ),
    (
        ["picture", "temperature", "{missing_dir}", "hello", "--out", OUT],
        "argument folder: {missing_dir}: no such model folder",
    ),
    (["picture", "curves", "{missing_dir}", "--out", OUT], "{missing_dir}: no such folder"),
    (
        ["picture", "curves", "{emptydir}", "--out", OUT],
        "{emptydir} has no metrics.jsonl: it was not written by `deriv train`",
    ),
]
BENCH_CASES = [
    (["bench", "decoder", "--layers", "0"], "argument --layers: must be an integer >= 1 and <= 512, got '0'"),
    (
        ["bench", "decoder", "--hidden", "30", "--heads", "4"],
        "--hidden 30 --heads 4: `hidden_size` (30) must be divisible by `num_attention_heads` (4)",
    ),
    (["bench", "decoder", "--gen-batches", "0"], "argument --gen-batches: must be an integer >= 1, got '0'"),
    (["bench", "decoder", "--threads", "0"], "argument --threads: must be an integer >= 1, got '0'"),
    (["bench", "decoder", "--new-tokens", "0"], "argument --new-tokens: must be an integer >= 1, got '0'"),
    (["bench", "decoder", "--context", "0"], "argument --context: must be an integer >= 2 and <= 131072, got '0'"),
    (
        ["bench", "decoder", "--json", "{missing_dir}/sub/out.json"],
        "--json {missing_dir}/sub/out.json: the folder {missing_dir}/sub does not exist",
    ),
    (["bench-seq2seq", "--beams", "0"], "argument --beams: must be an integer >= 1, got '0'"),
    (["bench-seq2seq", "--batch", "0"], "argument --batch: must be an integer >= 1, got '0'"),
    (
        ["bench-seq2seq", "--heads", "5"],
        "--heads 5 --ffn 1536: `hidden_size` (384) must be divisible by `encoder_attention_heads` (5)",
    ),
    (["bench-tokenizer", "--vocab-size", "100"], "argument --vocab-size: must be an integer >= 262, got '100'"),
    (["bench-tokenizer", "--slice-mb", "0"], "argument --slice-mb: must be a number > 0, got '0'"),
    (["bench-tokenizer", "--repeats", "0"], "argument --repeats: must be an integer >= 1, got '0'"),
    (["bench-training", "--presets", "huge"], "argument --presets: invalid choice: 'huge'"),
    (["bench-training", "--steps", "0"], "argument --steps: must be an integer >= 1, got '0'"),
    (["bench", "inference", "--new-tokens", "1"], "argument --new-tokens: must be an integer >= 2, got '1'"),
    (["bench", "inference", "--kv-positions", "999"], "--kv-positions 999: the models' context is 256"),
    (
        ["bench", "inference", "--prompt", "200", "--new-tokens", "100"],
        "--prompt + --new-tokens = 300: past --context 256",
    ),
    (["bench", "inference", "--paths", "eager"], "argument --paths: invalid choice: 'eager'"),
    # the device and the GPU check (issue 42)
    (["bench", "decoder", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["bench", "gpu", "--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["bench", "inference", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["bench", "serving", "--dtype", "half", "--no-server"], "argument --dtype: invalid choice: 'half'"),
    (["bench", "training", "--dtype", "int4"], "argument --dtype: invalid choice: 'int4'"),
    (["bench", "inference", "--compile-backend", "tvm"], "argument --compile-backend: invalid choice: 'tvm'"),
    (["bench", "gpu", "--json", "{emptydir}"], "--json {emptydir} is a folder; give the file to write"),
    (
        ["bench", "gpu", "--json", "{missing_dir}/sub/gpu.json"],
        "--json {missing_dir}/sub/gpu.json: the folder {missing_dir}/sub does not exist",
    ),
    (["bench", "gpu", "--dry-run", "--device", "cuda"], "--dry-run runs on the CPU; leave out --device cuda"),
    (
        ["bench", "training", "--peer", "--batch", "0"],
        "argument --batch: must be an integer >= 1 and <= 4096, got '0'",
    ),
    (
        ["bench", "training", "--peer", "--batch", "100000"],
        "argument --batch: must be an integer >= 1 and <= 4096, got '100000'",
    ),
    (
        ["bench", "training", "--peer", "--context", "1"],
        "argument --context: must be an integer >= 2 and <= 131072, got '1'",
    ),
    (
        ["bench", "training", "--peer", "--context", "1000000"],
        "argument --context: must be an integer >= 2 and <= 131072, got '1000000'",
    ),
    (
        ["bench", "training", "--peer", "--layers", "0"],
        "argument --layers: must be an integer >= 1 and <= 512, got '0'",
    ),
    (
        ["bench", "training", "--peer", "--layers", "100000"],
        "argument --layers: must be an integer >= 1 and <= 512, got '100000'",
    ),
    (["bench", "training", "--peer", "--steps", "0"], "argument --steps: must be an integer >= 1, got '0'"),
    (["bench", "training", "--peer", "--presets", "gpt2-1b"], "argument --presets: invalid choice: 'gpt2-1b'"),
    (["bench", "training", "--peer", "--compile-backend", "tvm"], "argument --compile-backend: invalid choice: 'tvm'"),
    (["bench", "training", "--peer", "--scaling"], "--peer times the steps of models it builds itself; --scaling"),
]
# `--device cuda` where torch sees no GPU (CI's machines; on one with a GPU these would run, so they are left out)
NO_CUDA_CASES = [
    (["bench", kind, "--device", "cuda", *extra], "sees no CUDA device; use --device cpu (or auto)")
    for kind, extra in [("decoder", []), ("inference", []), ("serving", ["--no-server"]), ("training", [])]
    + [("training", ["--peer"]), ("training", ["--scaling"]), ("gpu", [])]
]
TOP_CASES = [
    ([], "the following arguments are required: COMMAND"),
    (["bogus"], "argument COMMAND: invalid choice: 'bogus'"),
    (["train"], "the following arguments are required: task"),
    (["tokenizer"], "the following arguments are required: tokenizer_command"),
    (["picture"], "the following arguments are required: picture"),
]

# What a hostile user found accepted or answered with a traceback: each now one line, before any work.
FOUND_CASES = [
    (
        ["generate", "{lm_binary_config}", "hello"],
        "{lm_binary_config}/config.json is not valid JSON: not UTF-8 text (byte 128)",
    ),
    (
        ["generate", "{lm}", "hello", "--frequency-penalty", "1e9"],
        "argument --frequency-penalty: must be a number >= -2.0 and <= 2.0, got '1e9'",
    ),
    (
        ["generate", "{lm}", "hello", "--presence-penalty", "-2.5"],
        "argument --presence-penalty: must be a number >= -2.0 and <= 2.0, got '-2.5'",
    ),
    (
        ["chat", "{lm}", "--frequency-penalty", "3"],
        "argument --frequency-penalty: must be a number >= -2.0 and <= 2.0, got '3'",
    ),
    (
        ["serve", "{lm}", "--served-model-name", ""],
        "argument --served-model-name: '': give the id clients will send as `model`",
    ),
    (
        ["serve", "{lm}", "--served-model-name", "/etc/passwd"],
        "argument --served-model-name: '/etc/passwd': give the id clients will send as `model`",
    ),
    (
        ["serve", "{lm}", "--cb-num-blocks", "4"],
        "--cb-num-blocks size the paged cache of --continuous-batching, which is off",
    ),
    (
        ["serve", "{lm}", "--cb-max-batch-tokens", "64"],
        "--cb-max-batch-tokens size the paged cache of --continuous-batching, which is off",
    ),
    (["bench", "runtimes", "--vocab", "1"], "argument --vocab: must be an integer >= 16 and <= 1048576, got '1'"),
    (["bench", "runtimes", "--vocab", "100"], "--vocab 100: the BPE needs 262 to 1048576 ids"),
    (
        ["bench", "runtimes", "--context", "1000000000"],
        "argument --context: must be an integer >= 2 and <= 131072, got '1000000000'",
    ),
    (
        ["bench", "decoder", "--layers", "100000"],
        "argument --layers: must be an integer >= 1 and <= 512, got '100000'",
    ),
    (
        ["bench", "ablation", "--plot", "{emptydir}", "--output-dir", OUT],
        "--plot {emptydir} is a folder; give the file to write",
    ),
    (
        ["bench", "ablation", "--json", "{emptydir}", "--output-dir", OUT],
        "--json {emptydir} is a folder; give the file to write",
    ),
    (["bench", "decoder", "--json", "{emptydir}"], "--json {emptydir} is a folder; give the file to write"),
    (
        ["import", "{gpt2_odd_heads}", "--out", OUT],
        "{gpt2_odd_heads}/config.json describes a model that cannot be built: `embed_dim` must be divisible",
    ),
    (
        ["import", "{gpt2_no_tokenizer}", "--out", OUT],
        "{gpt2_no_tokenizer} has no tokenizer (no tokenizer.json, vocab.json and merges.txt, or SentencePiece model)",
    ),
    (
        ["picture", "curves", "{lm_empty_metrics}", "--out", OUT + ".png"],
        "{lm_empty_metrics}/metrics.jsonl holds no loss",
    ),
    (
        ["picture", "curves", "{lm_torn_metrics}", "--out", OUT + ".png"],
        "{lm_torn_metrics}/metrics.jsonl, line 1: not a JSON record",
    ),
    (["eval", "{mt_no_record}"], "{mt_no_record} has no run.json saying what it was trained on"),
    (["chat", "{lm_escaping_template}"], "{lm_escaping_template}: its chat template fails in jinja's sandbox"),
    (
        ["train", "sft", "--init-from", "{lm_escaping_template}", "--files", "{chats}", "--output-dir", OUT]
        + ["--max-steps", "1", "--no-progress", "--cpu"],
        "{lm_escaping_template}: its chat template fails in jinja's sandbox",
    ),
    # measured for 42 s, exited 0 and wrote nothing
    (["bench", "gpu", "--dry-run", "--json", ""], "--json '': give the name of the file to write"),
    (
        ["bench", "gpu", "--dry-run", "--json", "{a_file}/gpu.json"],
        "--json {a_file}/gpu.json: the folder {a_file} is a file, not a folder",
    ),
    (["bench", "decoder", "--json", " "], "--json ' ': give the name of the file to write"),
]

# Muon where it cannot run: LoRA's adapters (the update of a matrix is the product of two)
OPTIMIZER_CASES = [
    (
        [
            "train",
            "sft",
            "--init-from",
            "{lm}",
            "--files",
            "{chats}",
            "--output-dir",
            OUT,
            "--lora",
            "--optimizer",
            "muon",
        ]
        + ["--max-steps", "1", "--batch-size", "2", "--no-progress", "--cpu"],
        # a torch without Muon (the floors' 2.7) refuses the flag for that first, as the arguments are read
        "--optimizer muon does not train --lora adapters"
        if hasattr(torch.optim, "Muon")
        else "--optimizer muon needs torch.optim.Muon, which torch 2.9 brought",
    ),
]

# Text that is not valid Unicode, at every command-line entry point for text: a byte that is not UTF-8 (`$'\xff'`
# in a shell, which Python reads into argv as the surrogate \udcff) and a lone surrogate. The line names the
# argument; test_text_that_is_not_unicode_is_named_as_such checks how it names the text.
TEXT_CASES = [
    (["generate", "{lm}", "1 \udcff :"], "argument prompt: not valid text"),
    (["generate", "{lm}", "\ud800"], "argument prompt: not valid text"),
    (["chat", "{lm}", "--system", "\udcff"], "argument --system: not valid text"),
    (["translate", "{mt}", "\ud800"], "argument text: not valid text"),
    (["translate", "{mt}", "hello", "\udfff"], "argument text: not valid text"),
    (["attention", "{lm}", "\udcff"], "argument text: not valid text"),
    (["attention", "{mt}", "hello", "--target", "\ud800"], "argument --target: not valid text"),
    (["picture", "tokens", "{lm}", "\udcff"], "argument text: not valid text"),
    (["picture", "temperature", "{lm}", "\ud800"], "argument text: not valid text"),
    (["tokenizer", "show", "{tok}", "\udcff"], "argument text: not valid text"),
    # the model's id in every reply: such bytes made every reply, /health too, a 500 with a traceback
    (["serve", "{lm}", "--served-model-name", "model-\udcff"], "argument --served-model-name: not valid text"),
    (["serve", "{lm}", "--served-model-name", "\ud800"], "argument --served-model-name: not valid text"),
]

CASES = (
    TEXT_CASES
    + TOKENIZER_TRAIN_CASES
    + TOKENIZER_USE_CASES
    + TRAIN_LM_CASES
    + TRAIN_MT_CASES
    + GENERATE_CASES
    + TRANSLATE_CASES
    + EVAL_CASES
    + HUB_CASES
    + VIZ_CASES
    + BENCH_CASES
    + (NO_CUDA_CASES if not torch.cuda.is_available() else [])
    + TOP_CASES
    + FOUND_CASES
    + OPTIMIZER_CASES
)


PROGRESS = re.compile(r"\[\d\d:\d\d[<,]")  # tqdm's "[00:00<?, ...]" / "[00:00, ...]"


def case_id(case: list[str]) -> str:
    return " ".join(arg[:24] if arg else "''" for arg in case) or "(nothing)"


def digest(folder: str) -> str:
    """A hash of every file's relative path and bytes under `folder`."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            h.update(os.path.relpath(path, folder).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def test_the_table_is_large_enough():
    assert len(CASES) >= 150, len(CASES)
    assert len({case_id(c) for c, _ in CASES}) == len(CASES), "two cases with the same id"
    assert all(names.strip() for _, names in CASES), "a row without what its line must say"


@pytest.mark.parametrize("case, names", CASES, ids=[case_id(c) for c, _ in CASES])
def test_bad_input_is_one_clear_line_and_changes_nothing(case, names, paths, capsys):
    argv = [arg.format(**paths) for arg in case]
    watched = [paths[k] for k in ("lm", "mt", "tok", "corpus", "pairs")]
    before = [digest(w) if os.path.isdir(w) else hashlib.sha256(open(w, "rb").read()).hexdigest() for w in watched]
    capsys.readouterr()
    out_path = OUT.format(**paths)
    try:
        status = main(argv)
    except SystemExit as stop:
        status = stop.code
    finally:
        left_behind = os.path.exists(out_path)
        shutil.rmtree(out_path, ignore_errors=True)  # so that one failing case does not fail the next
    out, err = capsys.readouterr()
    # a progress bar that had started (reading a corpus) may stand before the error; nothing else may
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and not PROGRESS.search(line)]
    assert status == 2, f"exit status {status!r}; stderr: {err[-2000:]}"
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("deriv: error: "), err[-2000:]
    # subtle: the line must name this row's fault: a refusal for another reason (a missing file, a missing extra,
    # an unknown flag) is also one `deriv: error:` line with status 2, and would pass the checks above
    assert names.format(**paths) in lines[0], f"the line does not say {names!r}: {lines[0]!r}"
    after = [digest(w) if os.path.isdir(w) else hashlib.sha256(open(w, "rb").read()).hexdigest() for w in watched]
    assert before == after, "a folder or file the command was given changed"
    assert not left_behind, "an output was left behind"


@pytest.mark.parametrize("case", [c for c, _ in TEXT_CASES], ids=case_id)
def test_text_that_is_not_unicode_is_named_as_such(case, paths, capsys):
    try:
        status = main([arg.format(**paths) for arg in case])
    except SystemExit as stop:
        status = stop.code
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2 and "not valid text: " in line, line
    assert ("the byte 0xff, which is not UTF-8" in line) or ("a lone surrogate (U+D" in line), line


# Muon where the run cannot give it whole matrices or where torch lacks it, the run otherwise good: the variable
# `accelerate launch` sets for an FSDP config, and a torch older than 2.9 (the package's floor is 2.7).
MUON_REFUSED = {
    "under FSDP": lambda patch: patch.setenv("ACCELERATE_USE_FSDP", "true"),
    "on a torch without Muon": lambda patch: patch.delattr(torch.optim, "Muon", raising=False),
}


@pytest.mark.parametrize("where", list(MUON_REFUSED))
def test_muon_where_it_cannot_run_is_one_line_naming_the_flag(where, paths, monkeypatch, capsys):
    MUON_REFUSED[where](monkeypatch)
    out = OUT.format(**paths)
    argv = ["train", "lm", "--files", paths["corpus"], "--output-dir", out, *TINY_LM, "--optimizer", "muon"]
    capsys.readouterr()
    try:
        status = main(argv)
    finally:
        left_behind = os.path.exists(out)
        shutil.rmtree(out, ignore_errors=True)
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and not PROGRESS.search(line)]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert lines[0].startswith("deriv: error: --optimizer muon "), lines
    assert not left_behind


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_debug_shows_the_traceback_instead(how, tmp_path, monkeypatch):
    argv = ["train", "lm", "--output-dir", str(tmp_path / "out"), "--config", str(tmp_path / "missing.yaml")]
    if how == "flag":
        argv = ["--debug", *argv]
    else:
        monkeypatch.setenv("DERIV_DEBUG", "1")
    with pytest.raises(FileNotFoundError, match="No such config file"):
        main(argv)


def test_a_bug_keeps_its_traceback(monkeypatch, capsys):
    """Only bad input is reduced to one line: an error of another kind is not swallowed, it is shown as a bug."""
    from deriv_lm.bench import training

    def broken(args):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(training, "run", broken)
    assert main(["bench-training", "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError: a bug" in err
    assert err.strip().splitlines()[-1].startswith("deriv: this is a bug in deriv")


# ---- a missing optional extra -------------------------------------------------------------------------------------

# (command, the module made unimportable, how the command is named, the extra that brings the module)
EXTRA_CASES = [
    (["attention", "{lm}", "hello", "--out", OUT], "matplotlib", "deriv attention", "viz"),
    (["picture", "positions", "--out", OUT], "matplotlib", "deriv picture positions", "viz"),
    (["picture", "tokens", "{tok}", "hello", "--out", OUT], "matplotlib", "deriv picture tokens", "viz"),
    (["picture", "temperature", "{lm}", "hello", "--out", OUT], "matplotlib", "deriv picture temperature", "viz"),
    (["picture", "curves", "{lm}", "--out", OUT], "matplotlib", "deriv picture curves", "viz"),
    (["picture", "kv-memory", "--out", OUT], "matplotlib", "deriv picture kv-memory", "viz"),
    (["export", "{lm}", "--to", "onnx", "--out", OUT], "onnx", "deriv export --to onnx", "onnx"),
    (["export", "{lm}", "--to", "onnx", "--out", OUT], "onnxscript", "deriv export --to onnx", "onnx"),
    (["quantize", "{lm}", "--out", OUT], "torchao", "deriv quantize", "quantize"),
    (["train", "sft", "--lora", "--output-dir", OUT], "peft", "deriv train sft --lora", "lora"),
    (["import", "{marian}", "--out", OUT], "sentencepiece", "deriv import", "marian"),
    (["bench", "serving"], "fastapi", "deriv bench serving (without --no-server)", "serve"),
]


def block(monkeypatch, module: str) -> None:
    """As if `module` were not installed: it and its submodules, imported already or not, fail to import."""
    for name in [n for n in sys.modules if n.startswith(f"{module}.")] + [module]:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize(
    "case, module, command, extra", EXTRA_CASES, ids=[f"{case_id(c[0])} without {c[1]}" for c in EXTRA_CASES]
)
def test_a_missing_extra_is_one_line_with_the_pip_line(case, module, command, extra, paths, monkeypatch, capsys):
    argv = [arg.format(**paths) for arg in case]
    block(monkeypatch, module)
    capsys.readouterr()
    try:
        status = main(argv)
    finally:
        left_behind = os.path.exists(OUT.format(**paths))
        shutil.rmtree(OUT.format(**paths), ignore_errors=True)
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip() and not PROGRESS.search(line)]
    assert status == 2, err[-2000:]
    assert lines[-1] == f"deriv: error: {command} needs the {extra} extra: pip install 'deriv-lm[{extra}]'", err
    assert [line for line in lines if line.startswith("deriv:")] == lines[-1:], err
    assert not left_behind


def test_an_extra_that_is_installed_but_does_not_import_says_why(monkeypatch, capsys):
    import importlib

    real = importlib.import_module

    def broken(name, *args, **kwargs):
        if name == "matplotlib":
            raise ImportError("libfreetype.so.6: cannot open shared object file")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", broken)
    assert main(["picture", "positions"]) == 2
    assert capsys.readouterr().err.strip() == (
        "deriv: error: deriv picture positions needs the viz extra (matplotlib is installed but does not import: "
        "libfreetype.so.6: cannot open shared object file): pip install 'deriv-lm[viz]'"
    )
