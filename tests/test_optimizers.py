"""The optimizers and the schedules (training/optim.py): Muon on the blocks' linear weights with AdamW on the rest
(`--optimizer muon`), and the warmup-stable-decay schedule (`--lr-schedule wsd`). Tiny models on the CPU."""

import json
import os
import re
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from conftest import TINY_SEQ2SEQ, make_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

from deriv_lm.errors import UsageError
from deriv_lm.training.args import ChatTrainingArguments, TrainingArguments, decay_steps
from deriv_lm.training.optim import (
    MuonWithAdamW,
    check_optimizer,
    hidden_matrices,
    muon_step_on_the_cpu,
    newton_schulz_float32,
    optimizer_and_schedule,
    warmup_stable_decay,
)


needs_muon = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon came with torch 2.9")


def names_of(model, parameters) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return sorted(names[id(p)] for p in parameters)


def muon_args(**overrides) -> TrainingArguments:
    values = dict(optimizer="muon", learning_rate=1e-2, muon_learning_rate=1e-2, warmup_steps=1, max_steps=10)
    return TrainingArguments(**{**values, **overrides})


# ---- which weights go where -------------------------------------------------------------------------------------


def block_matrices(layers: int, gated: bool = False) -> list[str]:
    names = []
    for i in range(layers):
        names += [f"model.layers.{i}.self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [f"model.layers.{i}.mlp.{x}.weight" for x in ("fc1", "fc2") + (("gate",) if gated else ())]
    return sorted(names)


def test_muon_steps_exactly_the_blocks_linear_weights():
    """Not the token embedding, the learned position table (both 2-D), the tied head, a gain or a bias."""
    model = make_model(position_embedding_type="learned", gated_mlp=True)
    assert names_of(model, hidden_matrices(model)) == block_matrices(2, gated=True)


def test_an_untied_head_is_not_one_of_the_hidden_matrices():
    model = make_model(tie_word_embeddings=False)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert names_of(model, hidden_matrices(model)) == block_matrices(2)


def test_the_encoder_decoders_hidden_matrices_are_both_sides_and_the_cross_attention():
    from deriv_lm.modeling_deriv import DerivForConditionalGeneration, DerivSeq2SeqConfig

    model = DerivForConditionalGeneration(DerivSeq2SeqConfig(**TINY_SEQ2SEQ))
    expected = []
    for side, attentions in (("encoder", ("self_attn",)), ("decoder", ("self_attn", "encoder_attn"))):
        for i in range(2):
            layer = f"model.{side}.layers.{i}"
            expected += [f"{layer}.{a}.{x}_proj.weight" for a in attentions for x in "qkvo"]
            expected += [f"{layer}.mlp.fc1.weight", f"{layer}.mlp.fc2.weight"]
    assert names_of(model, hidden_matrices(model)) == sorted(expected)


@needs_muon
def test_adamw_keeps_the_rest_with_its_grouping_and_every_weight_is_stepped_once():
    """AdamW decays its matrices (the embedding, the position table, an untied head), never gains or biases."""
    model = make_model(position_embedding_type="learned", tie_word_embeddings=False)
    optimizer, _ = optimizer_and_schedule(model, muon_args())
    assert isinstance(optimizer, MuonWithAdamW)
    decay, no_decay = optimizer.parts["adamw"].param_groups
    assert names_of(model, decay["params"]) == sorted(
        ["model.embed_tokens.weight", "model.embed_positions.weight", "lm_head.weight"]
    )
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 1 for p in no_decay["params"]) and len(no_decay["params"]) > 0
    (muon,) = optimizer.parts["muon"].param_groups
    assert names_of(model, muon["params"]) == block_matrices(2) and muon["weight_decay"] == 0.1
    stepped = [id(p) for group in optimizer.param_groups for p in group["params"]]
    assert sorted(stepped) == sorted(id(p) for p in model.parameters())


def test_adamw_by_default_is_one_adamw_over_every_weight():
    model = make_model()
    optimizer, _ = optimizer_and_schedule(model, TrainingArguments())
    assert type(optimizer) is torch.optim.AdamW
    assert [len(g["params"]) for g in optimizer.param_groups] == [
        sum(p.dim() >= 2 for p in model.parameters()),
        sum(p.dim() < 2 for p in model.parameters()),
    ]


# ---- what one step does -----------------------------------------------------------------------------------------


def one_dominant_direction(shape, generator) -> torch.Tensor:
    """A full-rank gradient with one singular value 100 times the others: U diag(1, .01, ..., .01) V^T."""
    rows, columns = shape
    k = min(rows, columns)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=generator))
    v, _ = torch.linalg.qr(torch.randn(columns, k, generator=generator))
    spectrum = torch.full((k,), 1e-2)
    spectrum[0] = 1.0
    return u @ torch.diag(spectrum) @ v.T


@needs_muon
def test_one_muon_step_moves_a_block_matrix_alike_in_every_singular_direction():
    """torch's Muon orthogonalises the update: a gradient with one direction 100 times the rest moves each block
    matrix by an update whose singular values are within 10 % of each other, RMS 0.2 lr (match_rms_adamw) at
    d 128; the embedding, stepped by AdamW, keeps most of its update in the one direction."""
    model = make_model(hidden_size=128, intermediate_size=256, num_hidden_layers=1)
    lr = 1e-2
    optimizer, _ = optimizer_and_schedule(model, muon_args(learning_rate=lr, muon_learning_rate=lr, weight_decay=0.0))
    generator = torch.Generator().manual_seed(0)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = one_dominant_direction(p.shape, generator) if p.dim() == 2 else torch.zeros_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        if p.dim() != 2:
            continue
        update = (p.detach() - before[name]).double()
        singular = torch.linalg.svdvals(update)
        top_share = float(singular[0] ** 2 / singular.pow(2).sum())
        if name in block_matrices(1):
            assert float(singular.max() / singular.min()) < 1.1, name
            assert 0.1 < float(update.pow(2).mean().sqrt()) / lr < 0.3, name
        else:
            assert top_share > 0.5, name


@needs_muon
def test_weight_decay_is_decoupled_and_the_same_in_both_groups():
    """With every gradient zero, each step only decays: every matrix (Muon's and AdamW's) by 1 - lr wd, never a
    gain or a bias."""
    model = make_model()
    args = muon_args(learning_rate=1e-2, muon_learning_rate=1e-2, weight_decay=0.5)
    optimizer, _ = optimizer_and_schedule(model, args)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for name, p in model.named_parameters():
        expected = before[name] * (1 - 1e-2 * 0.5) if p.dim() == 2 else before[name]
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=0, msg=name)


# ---- the schedule drives both groups, also after a checkpoint is loaded ------------------------------------------


def rates_of(optimizer) -> list[float]:
    """Each part's learning rate as it will step: AdamW's groups, then Muon's."""
    return [g["lr"] for part in optimizer.parts.values() for g in part.param_groups]


@needs_muon
def test_the_schedule_scales_both_groups_by_the_same_factor():
    args = muon_args(lr_schedule="wsd", learning_rate=1e-3, muon_learning_rate=2e-2, warmup_steps=2, decay_ratio=0.3)
    model = make_model()
    optimizer, scheduler = optimizer_and_schedule(model, args)
    factor = warmup_stable_decay(2, 10, 3, args.min_lr_ratio)
    for step in range(10):
        assert rates_of(optimizer) == [1e-3 * factor(step)] * 2 + [2e-2 * factor(step)], step
        optimizer.step()
        scheduler.step()


@needs_muon
def test_a_loaded_state_keeps_stepping_with_the_schedules_rates(tmp_path):
    """torch's load_state_dict gives each part new group dicts: the schedule must still set the rates they use.
    The state goes through torch.save and `weights_only=True`, as accelerate's checkpoints do."""
    args = muon_args(learning_rate=1e-3, muon_learning_rate=2e-2, warmup_steps=5)
    model = make_model()
    optimizer, scheduler = optimizer_and_schedule(model, args)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        scheduler.step()
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.bin")
    again, again_scheduler = optimizer_and_schedule(model, args)
    again.load_state_dict(torch.load(tmp_path / "optimizer.bin", weights_only=True))
    again_scheduler.load_state_dict(scheduler.state_dict())
    assert rates_of(again) == rates_of(optimizer)
    assert len(again.state) == len(optimizer.state) == sum(1 for _ in model.parameters())
    optimizer.step()
    scheduler.step()
    again.step()
    again_scheduler.step()
    assert rates_of(again) == rates_of(optimizer) == [1e-3 * 4 / 5] * 2 + [2e-2 * 4 / 5]


@needs_muon
def test_the_state_of_another_optimizer_is_refused_by_name():
    model = make_model()
    optimizer, _ = optimizer_and_schedule(model, muon_args())
    adamw, _ = optimizer_and_schedule(model, TrainingArguments())
    with pytest.raises(ValueError, match=r"not the state of Muon with AdamW \(its parts \['adamw', 'muon'\]\)"):
        optimizer.load_state_dict(adamw.state_dict())


# ---- warmup-stable-decay ----------------------------------------------------------------------------------------


def test_wsd_warms_up_holds_the_peak_then_decays_linearly_to_the_floor():
    factor = warmup_stable_decay(10, 100, decay_steps(100, 0.2), 0.1)
    assert [factor(s) for s in (0, 9)] == [0.1, 1.0]  # the warmup: (step + 1) / warmup
    assert {factor(s) for s in range(10, 81)} == {1.0}  # the plateau, and the decay's first step
    assert factor(90) == pytest.approx(0.55, abs=1e-15)  # halfway down from 1 to 0.1
    assert factor(99) == pytest.approx(0.1 + 0.9 / 20, abs=1e-15)  # the last step
    assert factor(100) == factor(150) == pytest.approx(0.1, abs=1e-15)


def test_the_decay_is_the_rounded_fraction_of_the_run_and_at_least_one_step():
    assert [decay_steps(600, 0.2), decay_steps(30, 0.1), decay_steps(4, 0.2), decay_steps(10, 1.0)] == [120, 3, 1, 10]


def library_and_ours(warmup: int, total: int, decay: int, floor: float):
    from transformers.optimization import get_wsd_schedule

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    library = get_wsd_schedule(optimizer, warmup, decay, total, decay_type="linear", min_lr_ratio=floor)
    ours = warmup_stable_decay(warmup, total, decay, floor)
    return [library.lr_lambdas[0](step) for step in range(total + 5)], [ours(step) for step in range(total + 5)]


def test_transformers_wsd_is_ours_after_the_warmup_bit_for_bit():
    """Why training/optim.py keeps its own: the library's warmup rises from min_lr_ratio (step / warmup, scaled);
    ours is the cosine's, (step + 1) / warmup."""
    library, ours = library_and_ours(60, 600, 120, 0.1)
    assert library[60:] == ours[60:]
    assert library[0] == 0.1 and ours[0] == 1 / 60  # lr_max min_ratio against lr_max / warmup at the first step
    assert library[:60] == pytest.approx([0.1 + 0.9 * step / 60 for step in range(60)], abs=1e-15) != ours[:60]


@pytest.mark.parametrize(
    "values, names",
    [
        (dict(decay_ratio=0.0), ["`decay_ratio`", "> 0 and <= 1"]),
        (dict(decay_ratio=1.5), ["`decay_ratio`", "> 0 and <= 1"]),
        (dict(lr_schedule="wsd", max_steps=100, warmup_steps=60, decay_ratio=0.5), ["--warmup-steps 60", "50 steps"]),
        (dict(lr_schedule="wsd", max_steps=100, warmup_steps=0, decay_ratio=1.01), ["`decay_ratio`"]),
        (dict(muon_learning_rate=0.0), ["`muon_learning_rate`"]),
        (dict(muon_momentum=1.0), ["`muon_momentum`"]),
        (dict(optimizer="sgd"), ["`optimizer` must be one of adamw, muon"]),
    ],
)
def test_bad_values_are_refused_naming_the_field(values, names):
    with pytest.raises(UsageError) as refused:
        TrainingArguments(**values)
    for name in names:
        assert name in str(refused.value)


def test_wsd_fits_a_run_whose_warmup_and_decay_fill_it():
    assert TrainingArguments(lr_schedule="wsd", max_steps=100, warmup_steps=50, decay_ratio=0.5).decay_ratio == 0.5
    assert TrainingArguments(lr_schedule="wsd", max_steps=100, warmup_steps=0, decay_ratio=1.0).decay_ratio == 1.0


# ---- where Muon cannot run --------------------------------------------------------------------------------------


def test_muon_on_a_torch_without_it_names_the_version_needed(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon", raising=False)
    needed = rf"--optimizer muon needs .* torch 2.9 .* this torch is {re.escape(torch.__version__)}"
    with pytest.raises(UsageError, match=needed):
        TrainingArguments(optimizer="muon")
    assert TrainingArguments(optimizer="adamw").optimizer == "adamw"  # the default never asks for it


@pytest.mark.parametrize(
    "mode, asked, refused",
    [
        (DistributedType.FSDP, None, "FSDP"),
        (DistributedType.DEEPSPEED, None, "DeepSpeed"),
        (DistributedType.NO, "FSDP", "FSDP"),  # one process launched with an FSDP config
        (DistributedType.MULTI_CPU, None, None),  # DDP: every process steps the whole matrix alike
        (DistributedType.NO, None, None),
    ],
)
@needs_muon
def test_muon_is_refused_under_sharding_by_name(mode, asked, refused, monkeypatch):
    for name in ("FSDP", "DEEPSPEED"):
        monkeypatch.delenv(f"ACCELERATE_USE_{name}", raising=False)
    if asked:
        monkeypatch.setenv(f"ACCELERATE_USE_{asked}", "true")
    accelerator = SimpleNamespace(distributed_type=mode)
    check_optimizer(TrainingArguments(optimizer="adamw"), accelerator)  # AdamW runs everywhere
    if refused is None:
        check_optimizer(TrainingArguments(optimizer="muon"), accelerator)
        return
    with pytest.raises(UsageError, match=rf"--optimizer muon does not run under {refused}: .* whole matrix"):
        check_optimizer(TrainingArguments(optimizer="muon"), accelerator)


@needs_muon
def test_muon_with_lora_is_refused_by_name():
    accelerator = SimpleNamespace(distributed_type=DistributedType.NO)
    with pytest.raises(UsageError, match="--optimizer muon does not train --lora adapters"):
        check_optimizer(ChatTrainingArguments(optimizer="muon", lora=True), accelerator)
    check_optimizer(ChatTrainingArguments(optimizer="muon"), accelerator)  # every weight: Muon's rule


# ---- runs -------------------------------------------------------------------------------------------------------

TINY_RUN = ["--vocab-size", "300", "--context-length", "16", "--hidden-size", "32", "--num-hidden-layers", "2"]
TINY_RUN += ["--num-attention-heads", "2", "--intermediate-size", "64", "--batch-size", "4", "--warmup-steps", "1"]
TINY_RUN += ["--learning-rate", "3e-3", "--log-every", "1", "--eval-every", "4", "--eval-batches", "1"]
TINY_RUN += ["--save-every", "2", "--samples", "0", "--num-proc", "1", "--no-progress", "--cpu", "--dropout", "0.1"]
MUON = ["--optimizer", "muon", "--muon-learning-rate", "2e-2", "--lr-schedule", "wsd", "--decay-ratio", "0.5"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    lines = (f"line {i}: the value of {i % 13} times {i % 7} is {(i % 13) * (i % 7)}" for i in range(200))
    path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    return path


def train_line(corpus, folder, *extra: str) -> list[str]:
    return ["train", "lm", "--files", str(corpus), "--output-dir", str(folder), *TINY_RUN, *MUON, *extra]


@pytest.fixture(scope="module")
def muon_run(tmp_path_factory, corpus):
    """`deriv train lm --optimizer muon --max-steps 4`, a checkpoint every 2 steps."""
    from deriv_lm.cli import main

    folder = tmp_path_factory.mktemp("muon") / "run"
    assert main(train_line(corpus, folder, "--max-steps", "4")) == 0
    return folder


@needs_muon
def test_a_muon_run_trains_logs_both_rates_and_checkpoints_both_parts(muon_run):
    records = [json.loads(line) for line in (muon_run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    # the logged rate is the next step's: warmup 1, the plateau, then the linear decay over the last 2 of 4 steps
    factors = [1.0, 1.0, 0.55, 0.1]
    assert [r["learning_rate"] for r in steps] == pytest.approx([3e-3 * f for f in factors], rel=1e-12)
    assert [r["muon_learning_rate"] for r in steps] == pytest.approx([2e-2 * f for f in factors], rel=1e-12)
    state = torch.load(muon_run / "checkpoints" / "step-0000004" / "optimizer.bin", weights_only=True)
    assert sorted(state) == ["adamw", "muon"] and len(state["muon"]["state"]) == len(block_matrices(2))
    run = json.loads((muon_run / "run.json").read_text())
    assert run["arguments"]["optimisation"]["optimizer"] == "muon"
    assert run["procedure"]["optimizer"].startswith("Muon on the blocks' linear weights (peak learning rate 0.02")
    assert "Muon on the blocks' linear weights" in (muon_run / "README.md").read_text()


@needs_muon
def test_a_muon_run_stopped_at_step_2_and_resumed_ends_with_the_same_weights(muon_run, corpus, tmp_path, monkeypatch):
    """Muon's momentum buffers are in the checkpoint: the resumed run's steps 3 and 4 are the uninterrupted run's,
    dropout included, bit for bit."""
    from deriv_lm.cli import main
    from deriv_lm.training.stops import STOP
    from deriv_lm.training.trainer import Trainer

    original = Trainer._step

    def stop_after_step_2(self, window):
        result = original(self, window)
        if self.state.step + 1 == 2:
            STOP.received = "SIGTERM"  # as the signal handler does: a checkpoint at the end of the step, then stop
        return result

    line = train_line(corpus, tmp_path / "run", "--max-steps", "4", "--tokenizer", str(muon_run / "tokenizer"))
    monkeypatch.setattr(Trainer, "_step", stop_after_step_2)
    assert main(line) == 130
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["step-0000002"]
    monkeypatch.setattr(Trainer, "_step", original)
    assert main([*line, "--resume"]) == 0
    whole, resumed = load_file(muon_run / "model.safetensors"), load_file(tmp_path / "run" / "model.safetensors")
    assert whole.keys() == resumed.keys()
    for name in whole:
        assert torch.equal(whole[name], resumed[name]), name


@needs_muon
def test_chat_fine_tuning_of_every_weight_runs_with_muon(tmp_path):
    """`deriv train sft --optimizer muon`: the same rule on the folder it starts from (LoRA is refused above)."""
    from test_sft import chat_args, conversation

    from deriv_lm.training.sft import train_sft

    chats = tmp_path / "chat.jsonl"
    chats.write_text("".join(json.dumps({"messages": conversation(i)}) + "\n" for i in range(40)))
    args = chat_args(tmp_path, chats, optimizer="muon", max_steps=2, eval_every=2, save_every=2, samples=0)
    assert_muon_stepped_the_hidden_matrices(train_sft(args, cpu=True), AutoModelForCausalLM)


def assert_muon_stepped_the_hidden_matrices(folder: str, auto_class) -> None:
    """The checkpoint of step 2 holds Muon's momentum for each of the exported model's hidden matrices."""
    state = torch.load(os.path.join(folder, "checkpoints", "step-0000002", "optimizer.bin"), weights_only=True)
    model = auto_class.from_pretrained(folder)
    assert sorted(state) == ["adamw", "muon"]
    assert len(state["muon"]["state"]) == len(hidden_matrices(model)) > 0
    run = json.loads(open(os.path.join(folder, "run.json")).read())
    assert run["procedure"]["optimizer"].startswith("Muon") and run["training"]["steps"] == 2


@needs_muon
def test_a_translation_run_trains_with_muon(tmp_path):
    from deriv_lm.training import TranslationTrainingArguments, train_translation

    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("".join(f"open file {n}\töffne Datei {n}\n" for n in range(60)), encoding="utf-8")
    shape = {k: v for k, v in TINY_SEQ2SEQ.items() if k != "vocab_size"}
    args = TranslationTrainingArguments(
        **{**shape, "max_position_embeddings": 24, "dropout": 0.0},
        output_dir=str(tmp_path / "mt"),
        files=[str(pairs)],
        vocab_size=300,
        optimizer="muon",
        max_steps=2,
        warmup_steps=1,
        batch_size=8,
        eval_every=2,
        save_every=2,
        num_beams=1,
        bleu_pairs=4,
        samples=0,
        progress=False,
    )
    assert_muon_stepped_the_hidden_matrices(train_translation(args, cpu=True), AutoModelForSeq2SeqLM)


@needs_muon
@pytest.mark.slow
def test_two_ddp_processes_with_muon_follow_one_process(tmp_path, corpus_file):
    """Under DDP each process steps the whole matrix with the all-reduced gradient: two processes of batch 4 log,
    step for step, the losses of one process of batch 4 x 2 accumulation steps (equal up to the order of float
    summation, which Muon's bfloat16 Newton-Schulz step may round apart a little)."""
    from test_distributed import LAUNCHERS, launch, losses
    from test_training import tiny_args

    from deriv_lm.training import train_lm

    common = dict(batch_size=4, dropout=0.0, max_steps=8, eval_every=4, save_every=4, log_every=1)
    one = tiny_args(tmp_path / "one", corpus_file, gradient_accumulation_steps=2, optimizer="muon", **common)
    one.muon_learning_rate = 2e-2
    train_lm(one, cpu=True)
    tokenizer = os.path.join(one.output_dir, "tokenizer")
    two = tiny_args(tmp_path / "two", corpus_file, cache_dir=one.cache_dir, tokenizer=tokenizer, **common)
    output = launch(two, LAUNCHERS["accelerate config"], "--tokenizer", tokenizer, *MUON[:4])
    assert "2 process(es) on cpu" in output
    state = torch.load(os.path.join(two.checkpoint_dir, "step-0000008", "optimizer.bin"), weights_only=True)
    assert sorted(state) == ["adamw", "muon"]  # the two processes stepped with Muon too
    first, second = losses(one), losses(two)
    assert len(first) == len(second) == 8
    for a, b in zip(first, second, strict=True):
        assert abs(a - b) < 1e-3, (first, second)


def exact_polar(matrix: torch.Tensor) -> torch.Tensor:
    """U Vᵀ of matrix = U Σ Vᵀ, in float64: what the Newton-Schulz iteration approaches."""
    u, _, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    return u @ vh


@needs_muon
@pytest.mark.parametrize("shape", [(96, 32), (32, 96)])
def test_the_float32_iteration_is_torchs_iteration_without_bfloat16s_rounding(shape):
    """The same iteration as torch's (the coefficients, the transposition of a tall matrix, five steps): within
    bfloat16's rounding of torch's result, and nearer the float64 run of the same iteration than torch's is."""
    import torch.optim._muon as torch_muon

    grad = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    coefficients, steps, eps = (3.4445, -4.775, 2.0315), 5, 1e-7
    ours = newton_schulz_float32(grad, coefficients, steps, eps)
    theirs = torch_muon._zeropower_via_newtonschulz(grad, coefficients, steps, eps).float()
    exact = newton_schulz_float32(grad.double(), coefficients, steps, eps)  # the same steps in float64
    assert ours.dtype == torch.float32 and ours.shape == grad.shape
    assert (ours - theirs).abs().max() < 0.05  # bfloat16 keeps 8 bits
    assert (ours.double() - exact).abs().max() < 1e-4 < (theirs.double() - exact).abs().max()
    singular = torch.linalg.svdvals(ours)
    assert 0.5 < singular.min() and singular.max() < 1.5  # near U Vᵀ's ones, as torch's docstring says
    assert torch.nn.functional.cosine_similarity(ours.flatten().double(), exact_polar(grad).flatten(), 0) > 0.9


@needs_muon
def test_a_cpu_muon_step_runs_the_float32_iteration_and_puts_torchs_back():
    """Inside `muon_step_on_the_cpu` torch's Muon steps with the float32 iteration (its update is the float32
    one's, not bfloat16's), and after it, and after a step that raised, torch's own function is in place."""
    import torch.optim._muon as torch_muon

    original = torch_muon._zeropower_via_newtonschulz
    weight = torch.nn.Parameter(torch.zeros(64, 16))
    weight.grad = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    muon = torch.optim.Muon([weight], lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False)
    with muon_step_on_the_cpu(muon):
        muon.step()
    # torch's default adjustment: lr sqrt(max(1, A / B)) = 0.1 x 2 for 64 x 16; no momentum: the update is NS(G)
    expected = -0.2 * newton_schulz_float32(weight.grad, (3.4445, -4.775, 2.0315), 5, 1e-7)
    torch.testing.assert_close(weight.detach(), expected, rtol=0, atol=1e-6)
    assert torch_muon._zeropower_via_newtonschulz is original
    with pytest.raises(RuntimeError, match="boom"), muon_step_on_the_cpu(muon):
        assert torch_muon._zeropower_via_newtonschulz is newton_schulz_float32
        raise RuntimeError("boom")
    assert torch_muon._zeropower_via_newtonschulz is original


@needs_muon
def test_a_muon_whose_parameters_are_not_on_the_cpu_keeps_torchs_iteration():
    import torch.optim._muon as torch_muon

    weight = torch.nn.Parameter(torch.zeros(8, 4, device="meta"))
    muon = torch.optim.Muon([weight], lr=0.1)
    with muon_step_on_the_cpu(muon):
        assert torch_muon._zeropower_via_newtonschulz is not newton_schulz_float32


@needs_muon
def test_the_trainers_muon_orthogonalises_every_block_matrix_in_float32_on_the_cpu(monkeypatch):
    """`MuonWithAdamW.step` (what the trainer steps) runs Muon inside `muon_step_on_the_cpu`: one float32 iteration
    per block matrix, none of bfloat16's."""
    import deriv_lm.training.optim as optim

    calls = []
    real = optim.newton_schulz_float32
    monkeypatch.setattr(optim, "newton_schulz_float32", lambda grad, *a: calls.append(grad.shape) or real(grad, *a))
    model = make_model(num_hidden_layers=1)
    optimizer, _ = optimizer_and_schedule(model, muon_args())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    assert sorted(calls) == sorted(p.shape for p in hidden_matrices(model))
