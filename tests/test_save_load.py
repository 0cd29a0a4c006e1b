"""The saved folder: safetensors round trip, Auto classes, remote code for users without the
package, pipeline, device_map, and clear errors on corrupt weights."""

import json

import pytest
import torch
from conftest import make_model, run_without_package
from safetensors import safe_open
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, pipeline

from deriv_lm import DerivConfig, DerivForCausalLM, DerivModel


def x_ids():
    return torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(0))


@pytest.fixture
def saved(tmp_path):
    model = make_model(seed=4)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    return model, folder


def test_folder_layout_and_auto_map(saved):
    _, folder = saved
    names = {p.name for p in folder.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "configuration_deriv.py",
        "modeling_deriv.py",
    } <= names
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map == {
        "AutoConfig": "configuration_deriv.DerivConfig",
        "AutoModel": "modeling_deriv.DerivModel",
        "AutoModelForCausalLM": "modeling_deriv.DerivForCausalLM",
    }


def test_safetensors_holds_weights_once_and_no_sinusoid(saved):
    model, folder = saved
    with safe_open(folder / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys
    assert "lm_head.weight" not in keys  # tied: restored from the embedding on load
    assert not any("embed_positions" in k for k in keys)  # a function of the position, recomputed


def test_round_trip_logits_identical_tied_and_sinusoid_exact(saved):
    model, folder = saved
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert type(loaded) is DerivForCausalLM
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.model.embed_positions.weight, model.model.embed_positions.weight)
    with torch.no_grad():
        assert torch.equal(loaded(x_ids()).logits, model(x_ids()).logits)


def test_auto_classes_resolve_the_registered_type(saved):
    _, folder = saved
    assert type(AutoConfig.from_pretrained(folder)) is DerivConfig
    assert type(AutoModel.from_pretrained(folder)) is DerivModel
    assert (
        type(
            AutoModelForCausalLM.from_config(
                DerivConfig(
                    vocab_size=50, hidden_size=8, num_attention_heads=2, num_hidden_layers=1, intermediate_size=16
                )
            )
        )
        is DerivForCausalLM
    )


def test_learned_positions_are_saved(tmp_path):
    model = make_model(position_embedding_type="learned")
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "model.embed_positions.weight" in set(f.keys())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(x_ids()).logits, model(x_ids()).logits)


@pytest.mark.slow
@pytest.mark.upstream
def test_loads_with_remote_code_in_a_process_without_the_package(saved, tmp_path):
    model, folder = saved
    with torch.no_grad():
        expected = model(x_ids()).logits
    torch.save(expected, tmp_path / "expected.pt")
    result = run_without_package(
        f"""
        import torch
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
        folder = {str(folder)!r}
        try:
            import deriv_lm
        except ModuleNotFoundError:
            pass
        else:
            raise SystemExit("the package is importable; the test would prove nothing")
        config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
        assert type(config).__name__ == "DerivConfig" and "transformers_modules" in type(config).__module__
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        x = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(model(x).logits, torch.load({str(tmp_path / "expected.pt")!r}))
        out = model.generate(x[:1], max_new_tokens=5, do_sample=False, eos_token_id=None)
        assert out.shape == (1, 15)
        base = AutoModel.from_pretrained(folder, trust_remote_code=True)
        assert type(base).__name__ == "DerivModel"
        print("REMOTE-OK")
        """,
        tmp_path,
    )
    assert result.returncode == 0 and "REMOTE-OK" in result.stdout, result.stderr[-3000:]


def test_text_generation_pipeline(saved, tiny_tokenizer):
    _, folder = saved
    tiny_tokenizer.save_pretrained(folder)
    generator = pipeline("text-generation", model=str(folder))
    out = generator("the quick brown", max_new_tokens=5, do_sample=False)
    assert out[0]["generated_text"].startswith("the quick brown")
    assert len(tiny_tokenizer(out[0]["generated_text"]).input_ids) > len(tiny_tokenizer("the quick brown").input_ids)


def test_device_map_auto_loads(saved):
    model, folder = saved
    loaded = AutoModelForCausalLM.from_pretrained(folder, device_map="auto")
    assert {p.device.type for p in loaded.parameters()} == {"cpu"}  # the only device on this machine
    with torch.no_grad():
        torch.testing.assert_close(loaded(x_ids()).logits.cpu(), model(x_ids()).logits)


def test_bf16_load_keeps_a_usable_sinusoid(saved):
    _, folder = saved
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert loaded.model.embed_positions.weight.dtype == torch.bfloat16
    table = loaded.model.embed_positions.weight.float()
    assert torch.allclose(table[1, :2], torch.tensor([0.8415, 0.5403]), atol=1e-2)
    assert torch.isfinite(loaded(x_ids()).logits).all()


def test_truncated_safetensors_names_the_file(saved):
    _, folder = saved
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(Exception) as excinfo:
        AutoModelForCausalLM.from_pretrained(folder)
    assert "model.safetensors" in str(excinfo.value)


def test_garbage_safetensors_names_the_file(saved):
    _, folder = saved
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(Exception) as excinfo:
        AutoModelForCausalLM.from_pretrained(folder)
    assert "model.safetensors" in str(excinfo.value)


def test_missing_weights_file_is_a_clear_error(saved):
    _, folder = saved
    (folder / "model.safetensors").unlink()
    with pytest.raises(OSError, match="model.safetensors|pytorch_model.bin"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_auto_device_map_never_splits_a_block():
    from accelerate import infer_auto_device_map

    model = make_model()
    layer_bytes = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    # Room for about one and a half blocks on a (pretend) GPU 0: the second block must go whole to the CPU.
    device_map = infer_auto_device_map(
        model,
        max_memory={0: int(layer_bytes * 1.5) + 300 * 32 * 4, "cpu": 10**9},
        no_split_module_classes=model._no_split_modules,
    )
    assert set(device_map.values()) == {0, "cpu"}
    for name in device_map:
        assert not name.startswith("model.layers.") or name.count(".") == 2, name
