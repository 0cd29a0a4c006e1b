"""The training levers for the GPU (issue 42; docs/training.md, "Levers for the GPU"), each proven on the CPU:

- a vocabulary padded to a multiple of 64 rows (`DerivConfig.pad_vocab_size_to_multiple_of`): the loss, logits and
  gradients of the unpadded model with the same rows, generate() never choosing a padding row, save and load,
  resizing, and every export writing the unpadded twin's weights;
- the chunked linear cross-entropy (`forward(loss_chunk_size=...)`, `modeling_deriv/linear_cross_entropy.py`): the
  loss and gradients of the plain path in float32 and bfloat16, with ignored labels and odd chunk sizes, through the
  whole model, under an incoming gradient other than 1, with one input frozen, and no intermediate larger than one
  chunk's logits;
- a training step that reads nothing back from the device outside the logging steps (counted by `DeviceReads`,
  itself proven on each read and syncing operation planted in a step), and a loss that is not a number still
  stopping the run (at the next read) with no checkpoint after it;
- the flags and presets that switch them.
"""

import json
import os
import sys

import pytest
import torch
from conftest import TINY, make_model
from safetensors.torch import load_file
from test_convert import ids, perturbed
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
from transformers.loss.loss_utils import ForCausalLMLoss

from deriv_lm import DerivConfig, DerivForCausalLM
from deriv_lm.convert import export_model
from deriv_lm.modeling_deriv.linear_cross_entropy import linear_cross_entropy
from deriv_lm.training import NonFiniteLoss, TrainingArguments, train_lm
from deriv_lm.training.args import PRESETS
from deriv_lm.training.callbacks import TrainerCallback


V, MULTIPLE, ROWS = 300, 64, 320  # TINY's vocabulary, padded to 320 rows
GPT2_SHAPED = dict(pre_norm=True, position_embedding_type="learned", scale_embedding=False, hidden_act="gelu_new")
LLAMA_SHAPED = dict(
    pre_norm=True,
    position_embedding_type="rotary",
    norm_type="rms_norm",
    gated_mlp=True,
    hidden_act="silu",
    num_key_value_heads=2,
    scale_embedding=False,
    bias=False,
)


def padded_twin(model: DerivForCausalLM, padding_scale: float | None = None) -> DerivForCausalLM:
    """`model` with its vocabulary padded to a multiple of 64 rows: the same weights, the same real rows, padding rows
    as drawn (or redrawn N(0, padding_scale^2))."""
    g = torch.Generator().manual_seed(11)
    config = DerivConfig(**{**model.config.to_dict(), "pad_vocab_size_to_multiple_of": MULTIPLE})
    twin = DerivForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in twin.state_dict().items():
            source = model.state_dict()[name]
            tensor[: source.shape[0]] = source
            if padding_scale is not None and tensor.shape != source.shape:
                extra = tensor[source.shape[0] :]
                extra.copy_(torch.randn(extra.shape, generator=g) * padding_scale)
    return twin


# ---- the padded vocabulary ------------------------------------------------------------------------------------


def test_the_padding_is_off_by_default_and_refused_unless_a_positive_integer():
    assert DerivConfig(**TINY).pad_vocab_size_to_multiple_of == 1 and DerivConfig(**TINY).padded_vocab_size == V
    assert DerivConfig(**TINY, pad_vocab_size_to_multiple_of=MULTIPLE).padded_vocab_size == ROWS
    assert DerivConfig(**{**TINY, "vocab_size": 320}, pad_vocab_size_to_multiple_of=MULTIPLE).padded_vocab_size == 320
    for bad in (0, -64):
        with pytest.raises(Exception, match="`pad_vocab_size_to_multiple_of` must be a positive integer"):
            DerivConfig(**TINY, pad_vocab_size_to_multiple_of=bad)


def test_a_folder_written_before_the_field_loads_unchanged(tmp_path):
    model = make_model()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("pad_vocab_size_to_multiple_of", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = DerivForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.pad_vocab_size_to_multiple_of == 1
    assert loaded.model.embed_tokens.weight.shape == (V, TINY["hidden_size"])
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_a_padded_model_has_the_unpadded_models_logits_loss_and_gradients():
    plain = make_model(seed=1, pre_norm=True)
    padded = padded_twin(plain)
    assert padded.lm_head.weight.shape[0] == ROWS and padded.lm_head.weight is padded.model.embed_tokens.weight
    x = ids(2, 16)
    labels = x.clone()
    labels[0, :5] = -100
    out, out_padded = plain(x, labels=labels), padded(x, labels=labels)
    assert out_padded.logits.shape == (2, 16, V)
    assert torch.equal(out_padded.logits, out.logits) and torch.equal(out_padded.loss, out.loss)  # exact in fp32
    out.loss.backward()
    out_padded.loss.backward()
    for name, parameter in padded.named_parameters():
        expected = dict(plain.named_parameters())[name].grad
        torch.testing.assert_close(parameter.grad[: expected.shape[0]], expected, rtol=0, atol=1e-7)
    assert not padded.lm_head.weight.grad[V:].any()  # no id scores or embeds a padding row


@pytest.mark.upstream
@pytest.mark.parametrize("options", [dict(do_sample=False), dict(do_sample=True, top_k=0), dict(num_beams=2)])
def test_generate_never_picks_a_padding_row(options):
    padded = padded_twin(make_model(seed=2, pre_norm=True), padding_scale=50.0)
    x = ids(1, 4)
    hidden = padded.model(x).last_hidden_state
    assert (padded.lm_head(hidden).argmax(-1) >= V).all()  # uncut, a padding row would win at every position
    torch.manual_seed(0)
    out = padded.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, min_new_tokens=12, **options)
    assert out.shape[-1] == 16 and out.max() < V


def test_a_padded_model_saves_and_loads_exactly(tmp_path):
    padded = padded_twin(make_model(seed=3))
    padded.save_pretrained(tmp_path)
    assert load_file(tmp_path / "model.safetensors")["model.embed_tokens.weight"].shape[0] == ROWS
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.pad_vocab_size_to_multiple_of == MULTIPLE and loaded.config.vocab_size == V
    for name, tensor in padded.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    x = ids()
    assert torch.equal(loaded(x).logits, padded(x).logits)


def test_resizing_a_padded_model_keeps_ids_and_rows_apart():
    padded = padded_twin(make_model(seed=4))
    rows_before = padded.model.embed_tokens.weight.detach().clone()
    padded.resize_token_embeddings(V + 5)
    assert padded.config.vocab_size == V + 5 and padded.model.embed_tokens.weight.shape[0] == ROWS
    weight = padded.model.embed_tokens.weight
    assert torch.equal(weight[:V], rows_before[:V])
    torch.testing.assert_close(weight[V : V + 5], rows_before[:V].mean(0).expand(5, -1))  # new ids: the mean
    assert padded(ids(vocab=V + 5)).logits.shape[-1] == V + 5
    padded.resize_token_embeddings(ROWS + 1)  # past the padding: a new multiple of 64
    assert padded.config.vocab_size == ROWS + 1 and padded.lm_head.weight.shape[0] == 384
    assert padded.lm_head.weight is padded.model.embed_tokens.weight
    with pytest.raises(ValueError, match="pads its vocabulary to a multiple of 64"):
        padded.resize_token_embeddings(400, pad_to_multiple_of=8)


def save_with_tokenizer(model, folder, tokenizer):
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("to, shape", [("gpt2", GPT2_SHAPED), ("llama", LLAMA_SHAPED)])
def test_the_export_of_a_padded_folder_is_the_export_of_its_unpadded_twin(to, shape, tmp_path, tiny_tokenizer):
    plain = perturbed(make_model(**shape, vocab_size=len(tiny_tokenizer)), seed=5)
    padded = padded_twin(plain, padding_scale=9.0)
    out = {}
    for name, model in (("plain", plain), ("padded", padded)):
        save_with_tokenizer(model, tmp_path / name, tiny_tokenizer)
        out[name] = AutoModelForCausalLM.from_pretrained(export_model(tmp_path / name, to, tmp_path / f"{name}-{to}"))
    assert out["padded"].config.vocab_size == len(tiny_tokenizer)
    expected = out["plain"].state_dict()
    for name, tensor in out["padded"].state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_the_gguf_of_a_padded_folder_is_the_gguf_of_its_unpadded_twin(tmp_path, tiny_tokenizer):
    gguf = pytest.importorskip("gguf", reason="the runtimes extra is not installed (pip install 'deriv-lm[runtimes]')")
    plain = perturbed(make_model(**LLAMA_SHAPED, vocab_size=len(tiny_tokenizer), tie_word_embeddings=False), seed=6)
    padded = padded_twin(plain, padding_scale=9.0)
    tensors = {}
    for name, model in (("plain", plain), ("padded", padded)):
        folder = save_with_tokenizer(model, tmp_path / name, tiny_tokenizer)
        reader = gguf.GGUFReader(export_model(folder, "gguf", tmp_path / f"{name}.gguf"))
        tensors[name] = {t.name: t.data.copy() for t in reader.tensors}
    assert tensors["padded"]["token_embd.weight"].shape[0] == len(tiny_tokenizer)
    assert tensors["padded"].keys() == tensors["plain"].keys()
    for name, array in tensors["padded"].items():
        assert (array == tensors["plain"][name]).all(), name


# ---- the chunked linear cross-entropy ---------------------------------------------------------------------------


def problem(dtype=torch.float32, rows: int = 6, length: int = 9, d: int = 16, vocab: int = 50, padded: int = 64):
    """Hidden states (rows, length, d), an output projection of `padded` rows for `vocab` ids, labels with ignored
    positions; all seeded."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, length, d, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(padded, d, generator=g) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (rows, length), generator=g)
    labels[0, :4] = -100
    labels[3] = -100
    return hidden, weight, labels


def plain_loss(hidden, weight, labels, vocab, **kwargs):
    """transformers' own causal LM loss over the logits of the real columns."""
    return ForCausalLMLoss((hidden @ weight.T)[..., :vocab], labels, vocab, **kwargs)


def loss_and_grads(loss_fn, hidden, weight, labels, **kwargs):
    hidden.grad = weight.grad = None
    loss = loss_fn(hidden, weight, labels, **kwargs)
    loss.backward()
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("chunk_size", [1, 7, 54, 1000])
@pytest.mark.parametrize("num_items", [None, 37])
def test_the_chunked_loss_and_its_gradients_are_the_plain_ones_in_float32(chunk_size, num_items):
    hidden, weight, labels = problem()
    count = None if num_items is None else torch.tensor(num_items)
    expected = loss_and_grads(plain_loss, hidden, weight, labels, vocab=50, num_items_in_batch=count)
    chunked = loss_and_grads(
        linear_cross_entropy, hidden, weight, labels, vocab_size=50, chunk_size=chunk_size, num_items_in_batch=count
    )
    assert expected[2][50:].abs().max() == 0 and chunked[2][50:].abs().max() == 0  # padding rows: no gradient
    for got, want in zip(chunked, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_chunked_loss_takes_labels_already_shifted():
    hidden, weight, labels = problem()
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    expected = loss_and_grads(plain_loss, hidden, weight, labels, vocab=50)
    got = loss_and_grads(linear_cross_entropy, hidden, weight, None, vocab_size=50, chunk_size=5, shift_labels=shifted)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_chunked_loss_and_its_gradients_are_the_plain_ones_in_bfloat16():
    hidden, weight, labels = problem(torch.bfloat16, d=32, vocab=200, padded=256)
    expected = loss_and_grads(plain_loss, hidden, weight, labels, vocab=200)
    chunked = loss_and_grads(linear_cross_entropy, hidden, weight, labels, vocab_size=200, chunk_size=13)
    assert chunked[1].dtype == chunked[2].dtype == torch.bfloat16
    torch.testing.assert_close(chunked[0], expected[0], rtol=1e-3, atol=1e-3)  # both sum in float32
    for got, want in zip(chunked[1:], expected[1:], strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.float().abs().max().item())


def scaled_grads(loss_fn, hidden, weight, labels, scale: float, **kwargs) -> list:
    """d (scale * loss) / d input for each input that needs one: the backward handed `scale` as its incoming
    gradient (what fp16 loss scaling, a loss weight or an accumulation window hand it), not 1."""
    inputs = [t for t in (hidden, weight) if t.requires_grad]
    loss = loss_fn(hidden, weight, labels, **kwargs)
    return list(torch.autograd.grad(loss, inputs, grad_outputs=torch.tensor(scale, dtype=loss.dtype)))


@pytest.mark.parametrize("scale", [0.25, -3.7, 1024.0])
def test_the_chunked_loss_scales_its_gradients_by_the_incoming_gradient(scale):
    """Its backward multiplies the gradients the forward computed by grad_output; one that took grad_output as 1
    would pass every test that backpropagates the loss itself, and give fp16 loss scaling wrong gradients."""
    hidden, weight, labels = problem()
    expected = scaled_grads(plain_loss, hidden, weight, labels, scale, vocab=50)
    got = scaled_grads(linear_cross_entropy, hidden, weight, labels, scale, vocab_size=50, chunk_size=7)
    unscaled = scaled_grads(plain_loss, hidden, weight, labels, 1.0, vocab=50)
    for g, want, one in zip(got, expected, unscaled, strict=True):
        assert not torch.allclose(want, one)  # the scale shows in the gradient: the comparison can tell
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6 * abs(scale))
    hidden.grad = weight.grad = None
    (linear_cross_entropy(hidden, weight, labels, vocab_size=50, chunk_size=7) * scale).backward()  # the same, by
    torch.testing.assert_close(hidden.grad, expected[0], rtol=1e-5, atol=1e-6 * abs(scale))  # a scaled loss


class MatrixProducts(TorchDispatchMode):
    """How many matrix products ran while the mode was on."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("frozen", ["weight", "hidden"], ids=["frozen head", "frozen below the head"])
def test_with_one_input_frozen_the_chunked_loss_gives_the_others_plain_gradient_and_computes_no_more(frozen):
    """A frozen output projection (fine-tuning the body) or frozen hidden states (training the head alone): the
    other input's gradient is the plain loss's, under a scale too, the frozen one gets none, and the forward
    computes only the gradient that is needed: per chunk, the logits and that one product (not three)."""
    hidden, weight, labels = problem()
    (hidden if frozen == "hidden" else weight).requires_grad_(False)
    expected = scaled_grads(plain_loss, hidden, weight, labels, 0.5, vocab=50)
    with MatrixProducts() as products:
        got = scaled_grads(linear_cross_entropy, hidden, weight, labels, 0.5, vocab_size=50, chunk_size=7)
    assert len(got) == 1
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    assert products.count == 2 * 8  # 54 positions in chunks of 7: 8 chunks, two products each
    loss = linear_cross_entropy(hidden, weight, labels, vocab_size=50, chunk_size=7)
    loss.backward()
    assert (hidden if frozen == "hidden" else weight).grad is None


def model_loss_and_grads(model, x, labels, autocast: bool = False, **kwargs):
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x, labels=labels, num_items_in_batch=torch.tensor(20), **kwargs)
    out.loss.backward()
    return out, {name: p.grad.float().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16 autocast"])
def test_through_the_whole_model_the_chunked_loss_gives_the_plain_gradients(autocast):
    model = padded_twin(make_model(seed=7, pre_norm=True)).train()
    x = ids(2, 16)
    labels = x.clone()
    labels[1, 8:] = -100
    plain, plain_grads = model_loss_and_grads(model, x, labels, autocast)
    chunked, grads = model_loss_and_grads(model, x, labels, autocast, loss_chunk_size=5)
    assert chunked.logits is None and plain.logits.shape[-1] == V
    tolerance = dict(rtol=2e-2, atol=1e-3) if autocast else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked.loss, plain.loss, **tolerance)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, **tolerance, msg=name)
    with torch.no_grad():  # evaluation: the loss alone, chunk by chunk
        torch.testing.assert_close(model(x, labels=labels, loss_chunk_size=5).loss, model(x, labels=labels).loss)


class LargestTensor(TorchDispatchMode):
    """The most elements any operation's output had while the mode was on."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in torch.utils._pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.largest = max(self.largest, leaf.numel())
        return out


def test_the_largest_intermediate_of_the_chunked_loss_is_one_chunks_logits():
    hidden, weight, labels = problem(rows=8, length=75, d=16, vocab=1000, padded=1024)  # 600 positions
    sizes = {}
    for name, loss_fn, kwargs in (
        ("plain", plain_loss, dict(vocab=1000)),
        ("chunked", linear_cross_entropy, dict(vocab_size=1000, chunk_size=50)),
    ):
        with LargestTensor() as mode:
            loss_and_grads(loss_fn, hidden, weight, labels, **kwargs)
        sizes[name] = mode.largest
    assert sizes["plain"] >= 600 * 1000  # the whole batch's logits
    assert sizes["chunked"] == 50 * 1024  # one chunk's: 50 positions by the 1024 rows


def test_a_bad_chunk_size_and_a_wrapped_output_projection_are_refused():
    model = make_model()
    x = ids()
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="`loss_chunk_size` must be a positive integer"):
            model(x, labels=x, loss_chunk_size=bad)
    model.lm_head = torch.nn.Sequential(model.lm_head)
    with pytest.raises(ValueError, match="needs the output projection as a plain nn.Linear, not Sequential"):
        model(x, labels=x, loss_chunk_size=4)


# ---- the training step: no host synchronisation ---------------------------------------------------------------


NUMBERS_TOKENIZER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "numbers_lm")  # 300 ids


def tiny_args(tmp_path, corpus_file, **overrides) -> TrainingArguments:
    """Tiny runs on the corpus with a tokenizer of 300 ids already trained (no run here trains one)."""
    values = dict(
        output_dir=str(tmp_path / "run"),
        files=[str(corpus_file)],
        tokenizer=NUMBERS_TOKENIZER,
        cache_dir=str(tmp_path / "cache"),
        vocab_size=300,
        max_position_embeddings=16,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        batch_size=4,
        max_steps=7,
        warmup_steps=1,
        log_every=4,
        eval_every=100,
        eval_batches=1,
        save_every=100,
        samples=0,
        progress=False,
        num_proc=1,
    )
    values.update(overrides)
    return TrainingArguments(**values)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the tensor methods that read values to the host: `.to` only when it names the host ("cpu"; see DeviceReads)
READS = ("item", "tolist", "cpu", "numpy", "to", "__float__", "__int__", "__bool__", "__index__")
aten = torch.ops.aten
# the operations that wait for the device: a value read (`_local_scalar_dense`: `torch.arange(t)`, `range(t)` in
# C++), a boolean answer about values, or an output whose size depends on the values (it must be known on the host)
SYNCING = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten._unique, aten._unique2, aten.unique_dim}
SYNCING |= {aten.unique_consecutive, aten.bincount, aten.equal, aten.allclose, aten.is_nonzero}
INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


def syncs(func, args, kwargs) -> bool:
    """Whether an aten operation waits for the device: one of SYNCING, a mask index (`x[mask]`, `x[mask] = v`: its
    positions are a nonzero), or repeat_interleave without the output size."""
    packet = func.overloadpacket
    if packet in INDEXING:
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if packet is aten.repeat_interleave:
        return kwargs.get("output_size") is None
    return packet in SYNCING


def names_the_host(args, kwargs) -> bool:
    """Whether `.to(*args, **kwargs)` moves to the host by name: `.to("cpu")`, `.to(device="cpu")`."""
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, str) and target.split(":")[0] == "cpu"


def charged() -> bool:
    """Whether the operation running now was called by this package's code: the first caller outside torch is a file
    of the repository, not a test, and not the loader's collator (which checks the ids of the batch it builds, a
    host tensor not yet on any device)."""
    frame = sys._getframe(2)
    while frame is not None and "/torch/" in frame.f_code.co_filename:
        frame = frame.f_back
    if frame is None or frame.f_code.co_name == "collate":
        return False
    name = frame.f_code.co_filename
    return name.startswith(REPO) and "/tests/" not in name and "site-packages" not in name


class SyncingOps(TorchDispatchMode):
    """Calls `note()` for each operation that waits for the device (`syncs`) that the package's code called."""

    def __init__(self, note):
        super().__init__()
        self.note = note

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if syncs(func, args, kwargs) and charged():
            self.note()
        return func(*args, **kwargs)


class DeviceReads(TrainerCallback):
    """Counts the reads from the device made by this package's code between one step's end and the next, while the
    loop runs: the tensor methods that read values (READS: `.item()`, `float(t)`, `if t:`, `.tolist()`, `.cpu()`,
    `.to("cpu")`, ...) and the operations that wait for the device (`syncs`: `x[mask]`, `nonzero`, `unique`,
    `torch.equal`, a scalar read inside an operation, ...). A read inside torch is charged to the package's code that
    called into torch, and counted once (the read a counted method makes inside is its own). Library internals are
    not counted: torch.optim reads its step counter, a host tensor on GPUs too.

    subtle: on a CPU run the device is the host, so `.to(device)` with a device object (`targets.to(hidden.device)`)
    cannot be told from a read and is not counted; `.to("cpu")` by name, and `.cpu()`, are. Used as a context
    manager around the run, so that a run that raises leaves no counting behind."""

    def __init__(self, monkeypatch):
        self.monkeypatch, self.count, self.between, self.mode = monkeypatch, 0, {}, None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.on_train_end(None)

    def note(self) -> None:
        self.count += 1

    def on_train_begin(self, trainer, **kwargs):
        for name in READS:
            self.monkeypatch.setattr(torch.Tensor, name, self.counted(name, getattr(torch.Tensor, name)))
        self.mode = SyncingOps(self.note).__enter__()

    def on_train_end(self, trainer, **kwargs):
        if self.mode is not None:
            self.mode, mode = None, self.mode
            mode.__exit__(None, None, None)
            self.monkeypatch.undo()

    def counted(self, name: str, method):
        def read(tensor, *args, **kwargs):
            if (name != "to" or names_the_host(args, kwargs)) and charged():
                self.note()
            return method(tensor, *args, **kwargs)

        return read

    def on_step_end(self, trainer, result, **kwargs):
        self.between[trainer.state.step - 1] = self.count  # reads since the end of the step before
        self.count = 0


@pytest.mark.parametrize("accelerator", [False, True], ids=["cpu rules", "accelerator rules"])
def test_a_training_step_reads_nothing_back_from_the_device_outside_the_logging_steps(
    tmp_path, corpus_file, monkeypatch, accelerator
):
    """With the accelerator's rules (no lookup raises, so the model checks its ids before each forward unless they
    were checked upstream) the step still reads nothing: the collator checked the batch on the host."""
    from deriv_lm.modeling_deriv import modeling_deriv
    from deriv_lm.training import LanguageModelTask, run

    if accelerator:
        monkeypatch.setattr(modeling_deriv, "lookup_fails_loudly", lambda device: False)
    args = tiny_args(tmp_path, corpus_file, max_steps=6, log_every=3, loss_implementation="chunked", loss_chunk_size=7)
    with DeviceReads(monkeypatch) as reads:
        run(args, LanguageModelTask(args), cpu=True, callbacks=[reads])
    # after steps 1, 2, 4 and 5 the next step ran and nothing was read; after step 3 the log record read its values
    assert {step: reads.between[step] for step in (1, 2, 4, 5)} == dict.fromkeys((1, 2, 4, 5), 0)
    assert reads.between[3] > 0
    lines = [json.loads(line) for line in open(os.path.join(args.output_dir, "metrics.jsonl"))]
    assert [line["tokens_seen"] for line in lines if "train_loss" in line] == [3 * 4 * 15, 6 * 4 * 15]


# one statement that reads from the device, on x (4, 3) floats, m its mask, i indices, r repeat counts
PLANTED_READS = {
    "item": "x[0, 0].item()",
    "float": "float(x[0, 0])",
    "int": "int(i[1])",
    "if": "if m[0, 0]: pass",
    "index": "range(i[1])",
    "tolist": "x.tolist()",
    "numpy": "x.numpy()",
    "cpu": "x.cpu()",
    "to cpu": 'x.to("cpu")',
    "to device=cpu": 'x.to(device="cpu")',
    "mask index": "x[m]",
    # subtle: a tensor value, not `x[m] = 0.0`, which torch 2.15 turns into masked_fill_ (no wait, not counted)
    "mask assignment": "x[m] = torch.ones(())",
    "nonzero": "torch.nonzero(m)",
    "where of a mask": "torch.where(m)",
    "masked_select": "x.masked_select(m)",
    "unique": "torch.unique(i)",
    "unique_consecutive": "torch.unique_consecutive(i)",
    "repeat_interleave": "x.repeat_interleave(r, dim=0)",
    "equal": "torch.equal(x, x)",
    "allclose": "torch.allclose(x, x)",
    "bincount": "torch.bincount(i)",
    "a tensor as a size": "torch.arange(i[1])",
}
NOT_READS = {  # the same kinds of operation, with nothing to wait for
    "index by ids": "x[i]",
    "to a dtype": "x.to(torch.float64)",
    "to its device": "x.to(x.device)",
    "masked_fill": "x.masked_fill(m, 0.0)",
    "where of three": "torch.where(m, x, 0.0)",
    "repeat_interleave sized": "x.repeat_interleave(r, dim=0, output_size=6)",
}


def reads_of(source: str, monkeypatch, filename: str) -> int:
    """What DeviceReads counts in one step whose code is `source`, compiled as the file `filename`."""
    x = torch.randn(4, 3)
    names = dict(torch=torch, x=x, m=x > 0, i=torch.tensor([0, 2, 2]), r=torch.tensor([1, 2, 0, 3]))
    trainer = type("Trainer", (), {"state": type("State", (), {"step": 1})})
    with DeviceReads(monkeypatch) as reads:
        reads.on_train_begin(trainer)
        exec(compile(source, filename, "exec"), names)
        reads.on_step_end(trainer, result=None)
    return reads.between[0]


@pytest.mark.parametrize("source", PLANTED_READS.values(), ids=PLANTED_READS)
def test_device_reads_counts_each_way_the_packages_code_can_wait_for_the_device(source, monkeypatch):
    """Planted in a step in the package's code (compiled under a file name of the package, which is how DeviceReads
    tells its code from torch's and the tests'), each read is counted, once; the same in a test is not."""
    assert reads_of(source, monkeypatch, os.path.join(REPO, "training", "planted.py")) == 1
    assert reads_of(source, monkeypatch, __file__) == 0


@pytest.mark.parametrize("source", NOT_READS.values(), ids=NOT_READS)
def test_device_reads_counts_no_operation_that_need_not_wait(source, monkeypatch):
    assert reads_of(source, monkeypatch, os.path.join(REPO, "training", "planted.py")) == 0


def test_a_loss_that_is_not_a_number_between_logs_stops_the_run_at_the_next_read(tmp_path, corpus_file, monkeypatch):
    original = DerivForCausalLM.forward
    calls = {"n": 0}

    def forward(self, *a, **k):
        out = original(self, *a, **k)
        if self.training:
            calls["n"] += 1
            if calls["n"] == 3:
                out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(DerivForCausalLM, "forward", forward)
    args = tiny_args(tmp_path, corpus_file, save_every=2, log_every=4, max_steps=8)
    with pytest.raises(
        NonFiniteLoss, match=r"became nan at step 3; stopping\. The last good checkpoint is .*-0000002"
    ):
        train_lm(args, cpu=True)
    assert os.listdir(args.checkpoint_dir) == ["step-0000002"]  # none at step 4, after the bad step


# ---- the flags and the presets ----------------------------------------------------------------------------------


def test_the_gpt2_sized_presets_switch_the_levers_on_and_the_small_ones_need_none():
    for name in ("gpt2-124m", "llama-124m"):
        args = TrainingArguments(**PRESETS[name])
        assert (args.pad_vocab_size_to_multiple_of, args.loss_implementation) == (64, "chunked")
        assert DerivConfig(vocab_size=args.vocab_size, **args.model_overrides()).padded_vocab_size == 50304
    for name in ("tiny", "small", "llama-tiny"):
        args = TrainingArguments(**PRESETS[name])
        assert (args.pad_vocab_size_to_multiple_of, args.loss_implementation) == (1, "plain")
        assert args.vocab_size % 64 == 0  # already a multiple: nothing to pad


def test_a_run_with_both_levers_exports_a_folder_that_loads_and_generates(tmp_path, corpus_file):
    levers = dict(pad_vocab_size_to_multiple_of=64, loss_implementation="chunked")
    args = tiny_args(tmp_path, corpus_file, max_steps=2, log_every=1, **levers)
    folder = train_lm(args, cpu=True)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.lm_head.weight.shape[0] == 320 and model.config.vocab_size == len(tokenizer) == 300
    out = pipeline("text-generation", model=model, tokenizer=tokenizer)(
        "Return the", max_new_tokens=5, do_sample=False
    )
    assert out[0]["generated_text"].startswith("Return the")
    run = json.load(open(os.path.join(folder, "run.json")))
    assert run["arguments"]["language_model"]["loss_implementation"] == "chunked"


@pytest.mark.slow
def test_a_chunked_run_logs_the_losses_of_a_plain_one(tmp_path, corpus_file):
    losses = {}
    for kind in ("plain", "chunked"):
        args = tiny_args(tmp_path / kind, corpus_file, max_steps=6, log_every=1, eval_every=3, dropout=0.0)
        args.pad_vocab_size_to_multiple_of, args.loss_implementation, args.loss_chunk_size = 64, kind, 9
        train_lm(args, cpu=True)
        lines = [json.loads(line) for line in open(os.path.join(args.output_dir, "metrics.jsonl"))]
        losses[kind] = [line.get("train_loss", line.get("val_loss")) for line in lines]
    assert len(losses["plain"]) >= 6
    torch.testing.assert_close(losses["chunked"], losses["plain"], rtol=1e-4, atol=1e-5)


def test_the_collator_names_an_id_outside_the_vocabulary():
    from deriv_lm.training.lm import collate

    good = [{"input_ids": torch.tensor([1, 2, 299])}]
    assert torch.equal(collate(good, vocab_size=300)["input_ids"], torch.tensor([[1, 2, 299]]))
    with pytest.raises(ValueError, match=r"Token id 300 is outside the vocabulary: ids must lie in \[0, 300\)"):
        collate([{"input_ids": torch.tensor([1, 300])}], vocab_size=300)


def test_an_id_in_the_padding_rows_is_refused_on_the_cpu_too():
    """On the CPU the lookup is the check, but a padded table has rows for ids past the vocabulary: those ids must
    be named as the others are, not embedded as a padding row."""
    model = padded_twin(make_model())
    vocab = model.config.vocab_size
    assert model.model.embed_tokens.num_embeddings > vocab
    with pytest.raises(ValueError, match=rf"Token id {vocab} is outside the vocabulary"):
        model(torch.tensor([[5, vocab]]))
    with pytest.raises(ValueError, match=rf"Token id {vocab} is outside the vocabulary"):
        model.generate(torch.tensor([[5, vocab]]), max_new_tokens=3, do_sample=False, pad_token_id=0)


def test_the_runs_samples_fit_a_context_the_prompt_alone_fills(tiny_tokenizer):
    """--context-length 4 --samples 3: each sample prompt (about ten ids here) is cut to its last ids and the
    continuation fits what is left, so the end-of-run samples never generate past the last position (which
    raised "Position 16 is past the end" at --context-length 16)."""
    from deriv_lm.training import TrainingArguments
    from deriv_lm.training.lm import SAMPLE_PROMPTS, LanguageModelTask

    args = TrainingArguments(max_position_embeddings=4, samples=3, vocab_size=300, output_dir="unused")
    model = make_model(max_position_embeddings=4, vocab_size=len(tiny_tokenizer))
    assert all(len(tiny_tokenizer(p)["input_ids"]) > 4 for p in SAMPLE_PROMPTS)
    lines = LanguageModelTask(args).samples(model, tiny_tokenizer)
    assert len(lines) == 3 and all(line.startswith("--- sample: ") for line in lines)
