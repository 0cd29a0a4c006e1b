"""The decoder's parallel plans are true: split by them, a folder gives the logits and tokens of one process.

`DerivConfig.base_model_tp_plan` / `base_model_pp_plan` and the head's `_tp_plan` / `_pp_plan` are what transformers'
own tensor and pipeline parallelism (`from_pretrained(..., distributed_config=...)`) and vLLM's Transformers backend
shard by. Fast: the plans name modules the models have; a model cut into two pipeline stages as both engines cut it
(the other stage's blocks replaced by an identity, the tied embedding kept on the last stage) adds the positions
once; a tensor-parallel size that would split a head, and any split of the encoder-decoder, are refused in one line.
Slow: `torchrun --nproc-per-node 2` on the CPU (gloo) loads the paper's, a Llama-shaped and a padded-vocabulary
folder with `trust_remote_code`, tensor-parallel and pipeline-parallel, with the logits and greedy tokens of one
process (the vLLM side of the same plans is the vLLM tests').
"""

import ast
import copy
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from conftest import TINY, TINY_SEQ2SEQ
from test_transformers_compat import DECODERS, decoder, save_tiny_folders
from torch import nn

from deriv_lm import DerivConfig, DerivForCausalLM, DerivForConditionalGeneration, DerivSeq2SeqConfig
from deriv_lm.hub_card.check import HIDE_PACKAGE
from deriv_lm.modeling_deriv.modeling_deriv import DerivAttention, DerivCrossAttention, DerivGatedMLP, DerivMLP


def matches(pattern: str, names: set[str]) -> bool:
    regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+") + r"$")
    return any(regex.match(name) for name in names)


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_plans_name_the_modules(name):
    model = decoder(name)
    names = {n for n, _ in model.model.named_modules()}
    for pattern in DerivConfig.base_model_tp_plan:
        if pattern.endswith(".gate") and not model.config.gated_mlp:
            continue  # the gate exists only in a gated feed-forward
        assert matches(pattern, names), pattern
    assert set(DerivConfig.base_model_pp_plan) <= names
    assert isinstance(model.model.layers, nn.ModuleList)
    # the library reads both plans off the model, the head's with the base model's
    assert model.tp_plan["lm_head"] == "colwise_gather_output"
    assert model.tp_plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert model.tp_plan["model.layers.*.mlp.fc2"] == "rowwise"
    assert set(model.pp_plan) == {"lm_head", "model.embed_tokens", "model.layers", "model.norm"}


class StagePlaceholder(nn.Identity):
    """What vLLM's `PPMissingLayer` and transformers' `PipelineIdentityLayer` are: an identity that takes any
    arguments and returns the first."""

    def forward(self, *args, **kwargs):
        return args[0] if args else next(iter(kwargs.values()))


def two_stages(model: DerivForCausalLM, split: int) -> tuple[DerivForCausalLM, DerivForCausalLM]:
    """`model` cut as vLLM and transformers cut it: each stage's missing blocks an identity, the final norm and head
    on the last stage only, the tied embedding kept on the last stage too (theirs is an nn.Identity subclass)."""
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    for i in range(split, len(model.model.layers)):
        first.model.layers[i] = StagePlaceholder()
    first.model.norm = StagePlaceholder()
    for i in range(split):
        last.model.layers[i] = StagePlaceholder()
    return first, last


@pytest.mark.parametrize(
    "name,overrides",
    [("paper", {}), ("padded", {}), ("llama", {}), ("paper", {"pre_norm": True, "num_hidden_layers": 3})],
    ids=["sinusoidal", "learned", "rotary", "sinusoidal-pre-norm-3-layers"],
)
def test_positions_are_added_by_the_first_stage_only(name, overrides):
    model = decoder(name, **overrides)
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 12]])
    positions = torch.arange(ids.shape[1])[None]
    first, last = two_stages(model, split=1)
    with torch.no_grad():
        whole = model(ids).logits
        sent = first.model(ids, position_ids=positions).last_hidden_state  # what the first stage sends
        staged = last(inputs_embeds=sent, position_ids=positions).logits
        # a caller's own inputs_embeds still get the positions added, as before
        embedded = model(inputs_embeds=model.model.embed_tokens(ids)).logits
    torch.testing.assert_close(staged, whole, rtol=0, atol=1e-6)
    torch.testing.assert_close(embedded, whole, rtol=0, atol=1e-6)


def test_a_later_stage_without_the_embedding_runs():
    # untied, a later stage holds no embedding at all: nothing reads the table it does not have
    model = decoder("paper", tie_word_embeddings=False)
    first, last = two_stages(model, split=1)
    last.model.embed_tokens = StagePlaceholder()
    ids = torch.tensor([[5, 17, 42, 99]])
    with torch.no_grad():
        staged = last(inputs_embeds=first.model(ids).last_hidden_state).logits
        torch.testing.assert_close(staged, model(ids).logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "overrides,field",
    [({"num_key_value_heads": 1}, "num_key_value_heads"), ({"num_attention_heads": 2, "hidden_size": 32}, None)],
    ids=["gqa-one-kv-head", "two-heads-fine"],
)
def test_tensor_parallel_size_that_splits_a_head_is_refused(overrides, field):
    model = decoder("llama", **overrides)
    config = SimpleNamespace(tp_size=2, pp_size=1)
    if field is None:  # 2 query and 2 key/value heads over 2 ranks: whole heads, so on to the library (no mesh)
        assert DerivForCausalLM.maybe_distribute_model(model, config, None) is model
        return
    with pytest.raises(ValueError, match=rf"`{field}` \(1\) divisible by 2") as error:
        DerivForCausalLM.maybe_distribute_model(model, config, None)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("sizes", [dict(tp_size=2, pp_size=1), dict(tp_size=1, pp_size=2)], ids=["tp", "pp"])
def test_encoder_decoder_split_is_refused(sizes):
    torch.manual_seed(0)
    model = DerivForConditionalGeneration(DerivSeq2SeqConfig(**TINY_SEQ2SEQ))
    with pytest.raises(ValueError, match="no tensor- or pipeline-parallel plan") as error:
        DerivForConditionalGeneration.maybe_distribute_model(model, SimpleNamespace(**sizes), None)
    assert "\n" not in str(error.value)
    # one process is no split: on to the library
    assert DerivForConditionalGeneration.maybe_distribute_model(model, SimpleNamespace(tp_size=1), None) is model


# Run by each of two processes: every folder loaded with the folder's own code, split by `kind`; rank 0 writes the
# logits of a prompt, its greedy tokens, and the shapes its rank holds (so a plan that split nothing would show).
SPLIT_RUN = """
import json, os, sys, torch
from transformers import AutoModelForCausalLM
folders, out, kind = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
try:
    from transformers.distributed import DistributedConfig
    split = {"distributed_config": DistributedConfig(**({"tp_plan": "auto"} if kind == "tp" else {"pp_size": 2}))}
except ImportError:  # before distributed_config (tensor parallelism only)
    split = {"tp_plan": "auto"}
ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 12]])
results = {}
for name, folder in folders.items():
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32, **split).eval()
    with torch.no_grad():
        logits = model(ids).logits
    tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    layers = model.model.layers
    held = [i for i, layer in enumerate(layers) if not isinstance(layer, torch.nn.Identity)]
    attn = layers[held[0]].self_attn
    shapes = {"q_proj": list(attn.q_proj.weight.to_local().shape if hasattr(attn.q_proj.weight, "to_local")
                             else attn.q_proj.weight.shape), "held": held}
    results[name] = {"logits": logits.tolist(), "tokens": tokens.tolist(), "shapes": shapes}
if int(os.environ.get("RANK", 0)) == 0:
    with open(out, "w") as f:
        json.dump(results, f)
# subtle: both ranks leave the group together; a rank that exits while gloo's threads still run is aborted
# ("terminate called without an active exception"), which a loaded machine made happen now and then
if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
"""


def run_split(kind: str, folders: dict[str, str], workdir) -> dict:
    script, cwd, out = workdir / "split.py", workdir / "cwd", workdir / f"{kind}.json"
    cwd.mkdir(exist_ok=True)
    script.write_text(HIDE_PACKAGE + SPLIT_RUN)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_MODULES_CACHE": str(workdir / "hf_modules"),
        "HF_HOME": str(workdir / "hf_home"),
    }
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*torchrun, str(script), json.dumps(folders), str(out), kind],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    folders = save_tiny_folders(tmp_path_factory.mktemp("folders"))
    del folders["seq2seq"]
    return folders


def one_process(folder: str) -> tuple[torch.Tensor, list]:
    model = DerivForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 12]])
    with torch.no_grad():
        logits = model(ids).logits
    tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    return logits, tokens.tolist()


@pytest.mark.slow
@pytest.mark.upstream
@pytest.mark.parametrize("kind", ["tp", "pp"])
def test_two_processes_give_one_process_logits(kind, folders, tmp_path):
    results = run_split(kind, folders, tmp_path)
    for name, folder in folders.items():
        logits, tokens = one_process(folder)
        got = results[name]
        torch.testing.assert_close(torch.tensor(got["logits"]), logits, rtol=0, atol=1e-5, msg=name)
        assert got["tokens"] == tokens, name
        layers = TINY["num_hidden_layers"]
        if kind == "tp":  # rank 0 holds half of q_proj's output columns, and every block
            assert got["shapes"] == {"q_proj": [TINY["hidden_size"] // 2, TINY["hidden_size"]], "held": [0, 1]}
        else:  # rank 0 holds the first half of the blocks, whole
            assert got["shapes"] == {"q_proj": [TINY["hidden_size"]] * 2, "held": list(range(layers // 2))}


# What vLLM's Transformers backend needs to fuse a module (its fusers read the forward's source and trace it): in
# the attention, `self.q_proj`, `self.k_proj` and `self.v_proj` each called once, on the forward's own input, in one
# block, and one attention-kernel call in the forward's own source; in the gated feed-forward, `act_fn`, `gate` and
# `fc1` each once, as act(gate(x)) * fc1(x). One code path: no branch in a feed-forward, only the cache's in the
# attention.
def forward_source(cls) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward)))).body[0]


def self_calls(funcdef: ast.FunctionDef, name: str) -> list[ast.Call]:
    uses = [n for n in ast.walk(funcdef) if isinstance(n, ast.Attribute) and n.attr == name]
    calls = [n for n in ast.walk(funcdef) if isinstance(n, ast.Call) and n.func in uses]
    assert len(uses) == len(calls) == 1, f"{name}: {len(uses)} uses, {len(calls)} calls"
    return calls[0]


def branches(funcdef: ast.AST) -> list[ast.AST]:
    """The statements that fork the code path (an expression like the dropout's `p if training else 0` does not)."""
    return [n for n in ast.walk(funcdef) if isinstance(n, (ast.If, ast.Match, ast.Try))]


@pytest.mark.parametrize("cls", [DerivAttention, DerivCrossAttention], ids=lambda c: c.__name__)
def test_attention_calls_the_kernel_once_in_its_forward(cls):
    funcdef = forward_source(cls)
    kernels = [n for n in ast.walk(funcdef) if isinstance(n, ast.Name) and n.id == "ALL_ATTENTION_FUNCTIONS"]
    assert len(kernels) == 1
    assert [n.func.id for n in ast.walk(funcdef) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)].count(
        "attention_interface"
    ) == 1


def test_self_attention_projects_q_k_v_side_by_side():
    funcdef = forward_source(DerivAttention)
    first_input = funcdef.args.args[1].arg  # the forward's own input (after self)
    calls = [self_calls(funcdef, name) for name in ("q_proj", "k_proj", "v_proj")]
    assert all(isinstance(c.args[0], ast.Name) and c.args[0].id == first_input for c in calls)
    top_level = [stmt for stmt in funcdef.body if any(c in ast.walk(stmt) for c in calls)]
    assert len(top_level) == 3  # three statements of the body itself, none inside a branch
    assert all(not branches(stmt) for stmt in top_level)
    assert len(branches(funcdef)) == 1  # the cache's: nothing about cross-attention or rotary positions


@pytest.mark.parametrize("cls", [DerivMLP, DerivGatedMLP], ids=lambda c: c.__name__)
def test_feed_forward_has_one_path(cls):
    funcdef = forward_source(cls)
    assert not branches(funcdef)
    assert len([n for n in ast.walk(funcdef) if isinstance(n, ast.Return)]) == 1
    act = self_calls(funcdef, "act_fn")
    if cls is DerivGatedMLP:  # act(gate(x)) * fc1(x), the pattern vLLM merges into one matrix
        gate, up = self_calls(funcdef, "gate"), self_calls(funcdef, "fc1")
        assert act.args[0] is gate and ast.dump(gate.args[0]) == ast.dump(up.args[0])
        assert any(isinstance(n, ast.BinOp) and {n.left, n.right} == {act, up} for n in ast.walk(funcdef))


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_module_choice_keeps_every_weight_name(name):
    model = decoder(name)
    block = {k.split(".", 3)[-1] for k in model.state_dict() if k.startswith("model.layers.0.")}
    names = {f"self_attn.{p}_proj.weight" for p in "qkvo"} | {"mlp.fc1.weight", "mlp.fc2.weight"}
    names |= {"self_attn_layer_norm.weight", "final_layer_norm.weight"}
    if model.config.gated_mlp:
        names.add("mlp.gate.weight")
    if model.config.bias:
        names |= {n.replace(".weight", ".bias") for n in names}
    assert block == names
    assert isinstance(model.model.layers[0].mlp, DerivGatedMLP if model.config.gated_mlp else DerivMLP)
