"""An OPUS-MT checkpoint as it comes: a MarianMTModel with MarianTokenizer's two SentencePiece models (source.spm
for the source side, target.spm for the target side, one vocab.json) and no tokenizer.json. Imported, it keeps
that tokenizer, and `deriv train translation --init-from` fine-tunes it as it fine-tunes an imported GPT-2: the
targets encoded with the target model, the exported folder loadable with the Auto classes. Built offline here:
both SentencePiece models are trained on a few sentences (the marian extra's sentencepiece)."""

import io
import json
import os

import pytest
import torch


pytest.importorskip("sentencepiece", reason="the marian extra is not installed (pip install 'deriv-lm[marian]')")

ENGLISH = [f"open file {n}" for n in range(60)] + ["save the document", "quit the program now"]
GERMAN = [f"öffne Datei {n}" for n in range(60)] + ["speichere das Dokument", "beende das Programm jetzt"]


def train_spm(lines: list[str], path, size: int) -> list[str]:
    """A unigram SentencePiece model of about `size` pieces written to `path`; returns its pieces in id order."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=size,
        hard_vocab_limit=False,  # as many pieces as the few sentences allow
        character_coverage=1.0,
        unk_id=0,
        bos_id=-1,
        eos_id=-1,
        pad_id=-1,
        minloglevel=2,
    )
    path.write_bytes(model.getvalue())
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    return [processor.id_to_piece(i) for i in range(processor.get_piece_size())]


@pytest.fixture(scope="module")
def opus_mt(tmp_path_factory):
    """A tiny OPUS-MT-shaped folder: two SentencePiece models over one shared vocabulary, Marian's ids (</s> 0,
    <unk> 1, <pad> 2), a MarianMTModel of that vocabulary."""
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    spm = tmp_path_factory.mktemp("spm")
    pieces = train_spm(ENGLISH, spm / "source.spm", 60) + train_spm(GERMAN, spm / "target.spm", 60)
    vocab = {"</s>": 0, "<unk>": 1, "<pad>": 2}
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    (spm / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    tokenizer = MarianTokenizer(str(spm / "source.spm"), str(spm / "target.spm"), str(spm / "vocab.json"))
    config = MarianConfig(
        vocab_size=len(tokenizer),
        decoder_vocab_size=len(tokenizer),
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        activation_function="swish",
        scale_embedding=True,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        forced_eos_token_id=None,
    )
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("opus") / "opus-mt-tiny"
    MarianMTModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def imported(opus_mt, tmp_path_factory):
    from deriv_lm.convert import import_model

    return import_model(str(opus_mt), tmp_path_factory.mktemp("imported") / "imported")


def test_the_source_and_target_sides_are_two_tokenizations(opus_mt):
    # the property the fine-tuning test leans on: a target encoded as a source gets other ids
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(opus_mt)
    assert type(tokenizer).__name__ == "MarianTokenizer"
    assert tokenizer(text_target=GERMAN[3]).input_ids != tokenizer(GERMAN[3]).input_ids


def test_an_imported_opus_mt_keeps_its_sentencepiece_tokenizer_ids_for_ids(opus_mt, imported):
    from transformers import AutoTokenizer

    from deriv_lm.folder.load import missing_files, read_folder

    names = set(os.listdir(imported))
    assert {"source.spm", "target.spm", "vocab.json"} <= names and "tokenizer.json" not in names
    source, copy = AutoTokenizer.from_pretrained(opus_mt), AutoTokenizer.from_pretrained(imported)
    for english, german in zip(ENGLISH[::7], GERMAN[::7], strict=True):
        assert copy(english).input_ids == source(english).input_ids
        assert copy(text_target=german).input_ids == source(text_target=german).input_ids
    assert not [p for p in missing_files(read_folder(imported)) if "tokenizer" in p]


def test_fine_tuning_an_imported_opus_mt_encodes_targets_with_its_target_model(imported, tmp_path):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from deriv_lm import DerivForConditionalGeneration
    from deriv_lm.cli import main
    from deriv_lm.data.packing import encoded_pairs
    from deriv_lm.data.parallel import Pair

    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("".join(f"{e}\t{g}\n" for e, g in zip(ENGLISH, GERMAN, strict=True)), encoding="utf-8")
    run = tmp_path / "run"
    flags = ["--init-from", str(imported), "--files", str(pairs), "--output-dir", str(run), "--max-steps", "2"]
    flags += ["--learning-rate", "1e-12", "--warmup-steps", "1", "--context-length", "24", "--batch-size", "8"]
    flags += ["--bleu-pairs", "2", "--num-beams", "1", "--samples", "0", "--no-progress", "--cpu"]
    assert main(["train", "translation", *flags]) == 0

    tokenizer = AutoTokenizer.from_pretrained(run)
    assert type(tokenizer).__name__ == "MarianTokenizer"
    data, _ = encoded_pairs([Pair(ENGLISH[5], GERMAN[5])], tokenizer, 24)
    target = tokenizer(text_target=GERMAN[5], add_special_tokens=False).input_ids
    assert data[0]["labels"] == target + [tokenizer.eos_token_id]  # the target model's pieces, then </s>

    model = AutoModelForSeq2SeqLM.from_pretrained(run).eval()
    start = DerivForConditionalGeneration.from_pretrained(imported).state_dict()
    for name, tensor in start.items():  # a vanishing step: the run began from the imported weights
        torch.testing.assert_close(model.state_dict()[name], tensor, atol=1e-6, rtol=0)
    batch = tokenizer([ENGLISH[1]], return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out.shape == (1, 7) and isinstance(tokenizer.decode(out[0], skip_special_tokens=True), str)
    assert json.loads((run / "run.json").read_text())["base_model"] == "imported"


def test_an_exported_opus_mt_names_marians_tokenizer_and_gives_the_same_ids(opus_mt, imported, tmp_path):
    from transformers import AutoTokenizer, MarianMTModel

    from deriv_lm.convert import export_model

    out = export_model(imported, "marian", tmp_path / "native")
    config = json.loads((tmp_path / "native" / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "MarianTokenizer" and "chat_template" not in config
    tokenizer, source = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(opus_mt)
    assert type(tokenizer).__name__ == "MarianTokenizer"
    assert tokenizer(ENGLISH[9]).input_ids == source(ENGLISH[9]).input_ids
    assert tokenizer(text_target=GERMAN[9]).input_ids == source(text_target=GERMAN[9]).input_ids
    assert MarianMTModel.from_pretrained(out).config.vocab_size == len(tokenizer)


def test_the_explorer_opens_an_imported_opus_mt(imported):
    """`deriv explore` on an OPUS-MT import: a SentencePiece tokenizer with no tokenizer.json (no merges to show), a
    target encoded with the target side's model, and steps through generate() as its own greedy decoding gives."""
    from transformers import AutoTokenizer

    from deriv_lm.viz.explorer import compute

    ex = compute.Explorer.open(str(imported))
    tokenizer = AutoTokenizer.from_pretrained(imported)
    assert compute.info(ex)["tokenizer"] == "MarianTokenizer"
    got = compute.analyze(ex, {"text": ENGLISH[3], "target": GERMAN[3]})
    target = tokenizer(text_target=GERMAN[3], add_special_tokens=False).input_ids
    assert [t["id"] for t in got["target_tokens"]] == [ex.model.config.decoder_start_token_id, *target]
    assert [t["id"] for t in got["tokens"]] == tokenizer(ENGLISH[3], add_special_tokens=False).input_ids
    assert compute.merges(ex, got["tokens"][0]["id"])["kind"] == "unknown"
    steps = compute.generate_steps(ex, {"text": ENGLISH[3], "target_ids": []}, mode="greedy", steps=2)
    source = torch.tensor([tokenizer(ENGLISH[3], add_special_tokens=False).input_ids])
    start = torch.tensor([[ex.model.config.decoder_start_token_id]])
    reference = ex.model.generate(source, decoder_input_ids=start, do_sample=False, num_beams=1, max_new_tokens=2)
    assert steps["ids"] == reference[0, 1:].tolist()
