"""PEFT on Deriv: default targets without `target_modules`, in either order of import; a LoRA model trains its
adapters alone; merged and unmerged exports reload and decode as the adapted model did in memory.

Tiny random models: where a test compares decoding, the adapters are initialised at random (PEFT starts LoRA's
B at zero, which leaves the model as it was), and the test first checks that they change the logits."""

import json
import os
import subprocess
import sys

import pytest
import torch


peft = pytest.importorskip("peft", reason="PEFT is not installed (the lora extra)")

from conftest import TINY, TINY_SEQ2SEQ, make_model  # noqa: E402
from peft import AutoPeftModelForCausalLM, IA3Config, LoraConfig, PeftModel, get_peft_model  # noqa: E402
from peft.tuners.ia3 import IA3Layer  # noqa: E402
from peft.tuners.lora import LoraLayer  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from deriv_lm import DerivForCausalLM, DerivForConditionalGeneration, DerivSeq2SeqConfig  # noqa: E402
from deriv_lm.modeling_deriv import register_peft_targets  # noqa: E402


# PEFT's PeftModel reads `model.is_gradient_checkpointing`, which transformers 5.24 deprecates for
# `is_activation_checkpointing`: PEFT's call, not Deriv's.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

PROMPTS = torch.tensor([[1, 24, 226, 21, 226], [1, 27, 267, 74, 272]])


def adapted(model, layer_class=LoraLayer) -> set[str]:
    """The names, below the PEFT wrapper, of the modules that carry an adapter."""
    prefix = "base_model.model."
    return {name.removeprefix(prefix) for name, module in model.named_modules() if isinstance(module, layer_class)}


def decode(model) -> torch.Tensor:
    return model.generate(input_ids=PROMPTS, max_new_tokens=8, do_sample=False, eos_token_id=None)


def random_lora(model) -> PeftModel:
    """LoRA on the default targets with B drawn at random, so that the adapters change what the model says.

    The task type lets `AutoPeftModelForCausalLM` load the base through `AutoModelForCausalLM`; without one PEFT
    records the base's class by module and refuses to import a module outside its allowlist (`deriv_lm.*`)."""
    peft_model = get_peft_model(model, LoraConfig(r=8, init_lora_weights=False, task_type="CAUSAL_LM"))
    with torch.no_grad(), peft_model.disable_adapter():
        base_logits = peft_model(PROMPTS).logits
    assert not torch.allclose(peft_model(PROMPTS).logits, base_logits, atol=1e-3)  # the adapters matter
    return peft_model.eval()


def test_lora_defaults_to_the_query_and_value_projections_of_every_layer():
    peft_model = get_peft_model(make_model(), LoraConfig(r=8))
    layers = range(TINY["num_hidden_layers"])
    assert adapted(peft_model) == {f"model.layers.{i}.self_attn.{p}" for i in layers for p in ("q_proj", "v_proj")}


def test_lora_defaults_on_the_encoder_decoder_include_cross_attention():
    torch.manual_seed(0)
    peft_model = get_peft_model(DerivForConditionalGeneration(DerivSeq2SeqConfig(**TINY_SEQ2SEQ)), LoraConfig(r=8))
    expected = {f"model.encoder.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")}
    expected |= {
        f"model.decoder.layers.{i}.{attn}.{p}"
        for i in range(2)
        for attn in ("self_attn", "encoder_attn")
        for p in ("q_proj", "v_proj")
    }
    assert adapted(peft_model) == expected


def test_ia3_defaults_to_keys_values_and_the_feed_forward_input():
    peft_model = get_peft_model(make_model(), IA3Config())
    targets = {f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.k_proj", "self_attn.v_proj", "mlp.fc2")}
    assert adapted(peft_model, IA3Layer) == targets
    assert {name for name in targets if peft_model.get_submodule(f"base_model.model.{name}").is_feedforward} == {
        "model.layers.0.mlp.fc2",
        "model.layers.1.mlp.fc2",
    }


def test_registering_again_changes_nothing_and_keeps_a_users_entry():
    from peft.utils import constants

    lora = constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    lora["deriv_seq2seq"] = ["q_proj", "k_proj", "v_proj"]  # a user's own choice, which registering must keep
    try:
        before = {name: dict(table) for name, table in vars(constants).items() if isinstance(table, dict)}
        assert register_peft_targets() and register_peft_targets()
        after = {name: dict(table) for name, table in vars(constants).items() if isinstance(table, dict)}
        assert after == before and lora["deriv"] == ["q_proj", "v_proj"]
    finally:
        lora["deriv_seq2seq"] = ["q_proj", "v_proj"]


# A fresh interpreter imports the two packages in the given order and adapts a tiny decoder with no targets named.
IMPORT_ORDER_CHECK = """
import json, sys
first, second = sys.argv[1:]
__import__(first)
peft_imported_by_deriv = first == "deriv_lm" and "peft" in sys.modules
__import__(second)
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from deriv_lm import DerivConfig, DerivForCausalLM
config = DerivConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
model = get_peft_model(DerivForCausalLM(config), LoraConfig(r=2))
print(json.dumps({
    "peft_imported_by_deriv": peft_imported_by_deriv,
    "adapted": sorted(name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, LoraLayer)),
    "finders_left": [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_RegisterOnImport"],
}))
"""


@pytest.mark.parametrize("order", [("deriv_lm", "peft"), ("peft", "deriv_lm")], ids=["deriv-first", "peft-first"])
@pytest.mark.slow
def test_either_order_of_import_gives_the_defaults(order):
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ORDER_CHECK, *order],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"peft_imported_by_deriv": False, "adapted": ["q_proj", "v_proj"], "finders_left": []}


def test_a_lora_model_trains_its_adapters_and_nothing_else():
    peft_model = get_peft_model(make_model(), LoraConfig(r=8))
    base = {name: p.detach().clone() for name, p in peft_model.named_parameters() if "lora_" not in name}
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)

    peft_model.train()
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(5):
        loss = peft_model(input_ids=PROMPTS, labels=PROMPTS).loss
        loss.backward()
        assert all(p.grad is None for name, p in peft_model.named_parameters() if name in base)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.equal(p, base[name]) for name, p in peft_model.named_parameters() if name in base)


def test_merged_export_reloads_and_decodes_as_the_adapted_model(tmp_path):
    peft_model = random_lora(make_model())
    expected = decode(peft_model)

    merged = peft_model.merge_and_unload()
    assert not adapted(merged) and isinstance(merged, DerivForCausalLM)
    assert merged.lm_head.weight is merged.model.embed_tokens.weight  # still one tensor, not two copies
    merged.save_pretrained(tmp_path / "merged")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    assert torch.equal(decode(reloaded), expected)


def test_unmerged_export_is_the_adapter_alone_and_reloads_on_its_base(tmp_path):
    make_model().save_pretrained(tmp_path / "base")
    peft_model = random_lora(AutoModelForCausalLM.from_pretrained(tmp_path / "base"))
    expected = decode(peft_model)
    peft_model.save_pretrained(tmp_path / "adapter")

    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert keys and all("lora_A" in key or "lora_B" in key for key in keys)  # no copy of the base's weights
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    # The base is recorded as it was loaded: here a local path, which a published adapter must replace.
    assert config["base_model_name_or_path"] == str(tmp_path / "base")

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    assert torch.equal(decode(PeftModel.from_pretrained(base, tmp_path / "adapter").eval()), expected)
    assert torch.equal(decode(AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()), expected)
