"""The Hub room: model cards from the run records, the push dry run and its errors, and `deriv check`."""

import json
import shutil

import pytest
from conftest import cli_error
from huggingface_hub import ModelCard

from deriv_lm.cli import main
from deriv_lm.folder import missing_files, read_folder, upload_list
from deriv_lm.folder.load import unpublishable
from deriv_lm.hub_card import build_card, check_folder


@pytest.fixture(scope="module")
def lm_folder(tmp_path_factory):
    """A language model exported by `deriv train lm` (a few steps on a few default-corpus documents)."""
    from deriv_lm.data import default_corpus

    tmp = tmp_path_factory.mktemp("hub_lm")
    corpus = tmp / "corpus.jsonl"
    with open(corpus, "w") as f:
        for i, doc in enumerate(default_corpus()):
            if i >= 60:
                break
            f.write(json.dumps({"text": doc}) + "\n")
    args = ["train", "lm", "--files", str(corpus), "--output-dir", str(tmp / "lm"), "--cache-dir", str(tmp / "cache")]
    args += ["--vocab-size", "300", "--context-length", "32", "--hidden-size", "32", "--num-hidden-layers", "2"]
    args += ["--num-attention-heads", "2", "--intermediate-size", "64", "--batch-size", "4", "--max-steps", "6"]
    args += ["--warmup-steps", "2", "--eval-every", "3", "--eval-batches", "2", "--save-every", "6", "--samples", "1"]
    assert main([*args, "--num-proc", "1", "--no-progress", "--cpu"]) == 0
    return tmp / "lm"


@pytest.fixture(scope="module")
def mt_folder(tmp_path_factory):
    """A translation model exported by `deriv train translation` (a few steps on a made-up TSV corpus)."""
    tmp = tmp_path_factory.mktemp("hub_mt")
    data = tmp / "pairs.tsv"
    rows = [f"open the file {n}\töffne die Datei {n}" for n in range(60)] + [
        f"save {n}\tspeichere {n}" for n in range(60)
    ]
    data.write_text("\n".join(rows) + "\n", encoding="utf-8")
    args = ["train", "translation", "--files", str(data), "--output-dir", str(tmp / "mt"), "--vocab-size", "300"]
    args += ["--context-length", "24", "--hidden-size", "32", "--encoder-layers", "1", "--decoder-layers", "1"]
    args += ["--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
    args += ["--intermediate-size", "64", "--batch-size", "16", "--max-steps", "6", "--warmup-steps", "2"]
    args += ["--eval-every", "3", "--save-every", "6", "--num-beams", "2", "--no-progress", "--cpu"]
    assert main(args) == 0
    return tmp / "mt"


# ---- the card ---------------------------------------------------------------------------------------


def test_language_model_card_metadata_and_numbers_come_from_the_run(lm_folder):
    card = ModelCard.load(lm_folder / "README.md")  # written by the training command
    run = json.loads((lm_folder / "run.json").read_text())
    data = card.data
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert data.language is None  # a local corpus: its language is not known, so not claimed
    assert "custom_code" in data.tags and data.license == "apache-2.0"
    (result,) = data.eval_results
    assert result.metric_type == "perplexity" and result.dataset_split == "validation"
    assert result.metric_value == round(run["metrics"]["val_perplexity"], 4)
    body = card.text
    assert f"| parameters | {run['model']['parameters']:,} |" in body
    assert (
        f"{run['training']['steps']:,} optimizer steps" in body and "![Training and validation loss](loss.png)" in body
    )
    assert "AutoModelForCausalLM.from_pretrained" in body and "trust_remote_code=True" in body
    assert "Attention Is All You Need" in body and "@inproceedings{vaswani2017attention" in body


def test_translation_card_carries_bleu_and_chrf_with_signatures(mt_folder):
    card = ModelCard.load(mt_folder / "README.md")
    metrics = json.loads((mt_folder / "run.json").read_text())["metrics"]["task"]  # the translation task's own
    assert card.data.pipeline_tag == "translation" and card.data.language == ["en", "de"]
    by_type = {r.metric_type: r for r in card.data.eval_results}
    assert set(by_type) == {"perplexity", "bleu", "chrf"}
    assert by_type["bleu"].metric_value == round(metrics["bleu"], 2) and by_type["bleu"].dataset_split == "test"
    assert by_type["bleu"].metric_config == metrics["bleu_signature"]
    assert by_type["chrf"].metric_value == round(metrics["chrf"], 2)
    assert by_type["chrf"].metric_config == metrics["chrf_signature"]
    assert f"| copying the source | {metrics['copy_source_bleu']:.2f} |" in card.text
    assert 'pipeline(model="mt", trust_remote_code=True)' in card.text


def test_card_command_rewrites_the_same_card_and_parses_back(mt_folder, tmp_path):
    folder = tmp_path / "mt"
    shutil.copytree(mt_folder, folder)
    written_by_training = (folder / "README.md").read_text()
    assert main(["card", str(folder)]) == 0
    assert (folder / "README.md").read_text() == written_by_training  # one source of truth, deterministic
    assert main(["card", str(folder), "--repo-id", "someone/deriv-mt", "--license", "mit"]) == 0
    card = ModelCard.load(folder / "README.md")
    assert card.data.license == "mit" and 'pipeline(model="someone/deriv-mt"' in card.text
    again = ModelCard(card.content)  # the metadata survives a round trip through huggingface_hub
    assert again.data.to_dict() == card.data.to_dict()


def test_a_folder_without_training_records_says_so(lm_folder, tmp_path):
    folder = tmp_path / "bare"
    shutil.copytree(lm_folder, folder)
    (folder / "run.json").unlink()
    card = build_card(folder)
    assert card.data.eval_results is None and "model-index" not in card.content
    assert "has no training records" in card.text and "optimizer steps" not in card.text
    # nor does it claim an origin it has no record of (a `deriv import`ed folder was not trained by Deriv)
    assert "from-scratch" not in card.data.tags and "trained from scratch" not in card.text
    run = json.loads((lm_folder / "run.json").read_text())
    # the parameter count still comes from the weights themselves
    assert f"| parameters | {run['model']['parameters']:,} |" in card.text


def llama_shaped_folder(folder, tokenizer_from, **overrides):
    """A Llama-shaped Deriv folder (no run record): rotary, RMSNorm, SwiGLU, 4 heads on 2 kv heads, no biases."""
    import torch

    from deriv_lm import DerivConfig, DerivForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    shape.update(intermediate_size=96, max_position_embeddings=32, position_embedding_type="rotary", pre_norm=True)
    shape.update(norm_type="rms_norm", gated_mlp=True, hidden_act="silu", bias=False, scale_embedding=False)
    model = DerivForCausalLM(DerivConfig(**{**shape, **overrides}))
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, folder / name)
    return model


def table_rows(text: str) -> dict[str, str]:
    """{name: value} of the card's two-column table rows."""
    cells = [[c.strip() for c in line.strip().strip("|").split(" | ")] for line in text.splitlines()]
    return {row[0]: row[1] for row in cells if len(row) == 2 and row[0] and not row[0].startswith("---")}


def test_the_architecture_names_the_modern_switches_and_the_kv_cache(lm_folder, tmp_path):
    import torch

    model = llama_shaped_folder(tmp_path / "llama", lm_folder)
    rows = table_rows(build_card(tmp_path / "llama").text)
    assert rows["attention heads"] == "4, sharing 2 key/value heads (grouped-query attention)"
    assert rows["feed-forward size (d_ff)"].startswith("96 (SwiGLU")
    assert rows["positions"].startswith("rotary (RoPE, theta 10000)")
    assert rows["normalisation"] == "pre-LN, RMSNorm"
    assert rows["biases"].startswith("none")
    # the bytes each position adds to a real cache, in fp32: 2 x 3 layers x 2 kv heads x 16 dims x 4
    out = model(torch.tensor([[5, 6, 7, 8, 9]]), use_cache=True)
    cache = out.past_key_values
    real = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)) // 5
    assert real == 2 * 3 * 2 * 16 * 4
    assert rows["KV cache per token"].startswith(f"{real:,} bytes in fp32, {real // 2:,} in bf16")


def test_an_untied_model_is_not_described_as_tied(lm_folder, tmp_path):
    """Llama checkpoints mostly have their own output projection: the card says so, in the table and the prose."""
    llama_shaped_folder(tmp_path / "own-head", lm_folder, tie_word_embeddings=False)
    text = build_card(tmp_path / "own-head").text
    assert table_rows(text)["vocabulary"] == "300 tokens, its own output projection"
    assert "an output projection of its own" in " ".join(text.split()) and "tied" not in text
    assert "embedding tied to the output projection" in build_card(lm_folder).text


def test_a_paper_shaped_card_names_layernorm_and_every_head_caching(lm_folder):
    card = build_card(lm_folder)
    assert (
        "| attention heads | 2 |" in card.text and "| normalisation | post-LN (the paper's), LayerNorm |" in card.text
    )
    assert "residual connections with LayerNorm" in card.text and "biases" not in card.text
    assert "| KV cache per token | 512 bytes in fp32" in card.text  # 2 x 2 layers x 2 heads x 16 dims x 4


def test_the_card_is_rendered_from_the_template_shipped_in_the_package(lm_folder, tmp_path, monkeypatch):
    from importlib.resources import files

    from deriv_lm.hub_card import card as card_module

    shipped = files("deriv_lm.hub_card") / "templates" / "modelcard.md"
    assert shipped.is_file() and str(shipped) == card_module.TEMPLATE
    text = shipped.read_text(encoding="utf-8")
    assert "## Intended use and limitations" in text and "{{ card_data }}" in text
    # a marker section added to a copy of the template appears in the card, with the YAML header above it
    marked = tmp_path / "modelcard.md"
    marked.write_text(text.replace("## Citation", "## Marker\n\nrendered from {{ title }}\n\n## Citation"))
    monkeypatch.setattr(card_module, "TEMPLATE", str(marked))
    card = build_card(lm_folder, repo_id="someone/deriv-lm")
    assert "## Marker\n\nrendered from deriv-lm\n\n## Citation" in card.text
    assert card.data.pipeline_tag == "text-generation" and card.content.startswith("---\n")
    assert card.content.endswith("```\n")  # jinja2 drops a template's last newline; the card keeps its own


# ---- completeness and the dry run -------------------------------------------------------------------


def test_dry_run_of_a_complete_folder_lists_the_upload_and_sends_nothing(mt_folder, capsys):
    assert main(["push", str(mt_folder), "--repo-id", "someone/deriv-mt", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for name in ("README.md", "config.json", "model.safetensors", "pipeline_deriv.py", "tokenizer.json"):
        assert f"  {name} " in out
    assert "checkpoints" not in out and "tokenizer/" not in out  # kept for resuming, never uploaded
    assert "nothing was uploaded" in out


@pytest.mark.parametrize(
    "name",
    [
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
        "modeling_deriv_seq2seq.py",
        "modeling_deriv.py",  # imported by modeling_deriv_seq2seq.py, named nowhere in config.json
        "configuration_deriv.py",
        "pipeline_deriv.py",
    ],
)
def test_dry_run_of_a_folder_missing_a_file_fails_naming_it(mt_folder, tmp_path, capsys, name):
    folder = tmp_path / "mt"
    shutil.copytree(mt_folder, folder)
    (folder / name).unlink()
    code = main(["push", str(folder), "--repo-id", "someone/deriv-mt", "--dry-run"])
    assert code != 0
    captured = capsys.readouterr()
    assert name in captured.err


PLANTED = {
    "pytorch_model.bin": "a pickle: loading it can run code",
    "optimizer.pt": "a pickle: loading it can run code",
    "adapter/adapter_model.bin": "a pickle: loading it can run code",
    "run.sh": "not a file a model folder holds",
    "helpers.py": "Python that is not this package's own helpers.py",
    "modeling_deriv.py": "Python that is not this package's own modeling_deriv.py",
}


@pytest.mark.parametrize("planted", PLANTED)
@pytest.mark.parametrize("dry_run", [True, False], ids=["dry run", "upload"])
def test_push_refuses_a_file_a_model_folder_should_not_publish(
    lm_folder, tmp_path, capsys, monkeypatch, planted, dry_run
):
    """A planted pickle, a script, code beside or in place of the package's own: refused with status 2 and a line
    naming the file and why, in the dry run and in a real push alike (a token set, so the push could go ahead):
    the repository is never created."""
    import huggingface_hub

    folder = tmp_path / "lm"
    shutil.copytree(lm_folder, folder)
    target = folder / planted
    target.parent.mkdir(exist_ok=True)
    if planted == "modeling_deriv.py":  # the package's file, with one line more
        target.write_text(target.read_text() + "\nimport os  # planted\n")
    else:
        target.write_bytes(b"planted")

    def no_upload(*args, **kwargs):
        raise AssertionError("the push went ahead")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", no_upload)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    line = cli_error(["push", str(folder), "--repo-id", "someone/x", *(["--dry-run"] if dry_run else [])], capsys)
    assert f"{planted} ({PLANTED[planted]}" in line and "should not publish" in line, line


def test_the_folders_the_commands_write_are_publishable(lm_folder, mt_folder):
    for folder in (lm_folder, mt_folder):
        read = read_folder(folder)
        assert unpublishable(read, upload_list(read)) == []


def test_a_folder_without_auto_map_is_incomplete(lm_folder, tmp_path):
    folder = tmp_path / "lm"
    shutil.copytree(lm_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["auto_map"]
    (folder / "config.json").write_text(json.dumps(config))
    assert any("auto_map" in p for p in missing_files(read_folder(folder)))


def test_bad_input_is_a_clear_error(tmp_path, lm_folder, capsys, monkeypatch):
    from conftest import cli_error

    assert "not a model folder: it has no config.json" in cli_error(
        ["push", str(tmp_path), "--repo-id", "someone/x", "--dry-run"], capsys
    )
    assert "No such folder" in cli_error(["card", str(tmp_path / "nope")], capsys)
    assert "is not a valid repo id" in cli_error(
        ["push", str(lm_folder), "--repo-id", "not a/valid/id", "--dry-run"], capsys
    )
    # a real push without a token: refused before anything is sent
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no stored login either
    assert main(["push", str(lm_folder), "--repo-id", "someone/x"]) == 1
    err = capsys.readouterr().err
    assert "No Hugging Face token" in err and "Nothing was uploaded" in err


def test_a_push_that_cannot_reach_the_hub_fails_without_claiming_success(lm_folder, tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    # nothing listens on this loopback port: the connection is refused at once, no traffic leaves the machine
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    code = main(["push", str(lm_folder), "--repo-id", "someone/x"])
    captured = capsys.readouterr()
    assert code == 1 and "Upload to someone/x failed" in captured.err and "uploaded:" not in captured.out


# ---- deriv check ------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["lm_folder", "mt_folder"])
@pytest.mark.slow
@pytest.mark.upstream
def test_check_passes_on_exported_folders(request, which, capsys):
    folder = request.getfixturevalue(which)
    assert main(["check", str(folder)]) == 0
    out = capsys.readouterr().out
    for step in ("config", "tokenizer", "model", "generate", "pipeline"):
        assert f"PASS  {step}" in out
    assert "every step passed" in out


@pytest.mark.slow
def test_check_fails_clearly_without_the_code_files(lm_folder, tmp_path, capsys):
    folder = tmp_path / "lm"
    shutil.copytree(lm_folder, folder)
    for name in ("modeling_deriv.py", "configuration_deriv.py"):
        (folder / name).unlink()
    steps = {s["step"]: s for s in check_folder(folder)}
    assert not steps["config"]["ok"] and "configuration_deriv" in steps["config"]["detail"]
    assert not steps["model"]["ok"] and not steps["pipeline"]["ok"]
    assert main(["check", str(folder)]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_the_speedruns_qk_norm_and_soft_cap_are_in_the_table(lm_folder, tmp_path):
    """A folder with QK-norm and a logit soft cap says so (they change what the model computes); one without
    has neither row nor clause."""
    llama_shaped_folder(tmp_path / "speedrun", lm_folder, qk_norm=True, final_logit_softcapping=15.0)
    rows = table_rows(build_card(tmp_path / "speedrun").text)
    assert rows["QK-norm"].startswith("each head's queries and keys RMS-normalised")
    assert rows["vocabulary"].endswith("logits soft-capped to (-15, 15) by 15 tanh(z / 15)")
    plain = table_rows(build_card(lm_folder).text)
    assert "QK-norm" not in plain and "soft-capped" not in plain["vocabulary"]
