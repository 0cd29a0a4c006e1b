"""The explorer's numbers: tokens, embeddings, attention, the next token's distribution and generation steps
of one loaded folder, as JSON-ready dicts (never tensors). Bulky arrays (an attention map, the embeddings, the
attention overview) travel as base64 of their bytes (`encode`): float32 exactly as the model computed them, so the
page holds the model's own values, in a fraction of the bytes of decimal JSON.

Every number comes from the model's own code paths: one eager forward pass with `output_attentions=True` for
the attention and the logits, transformers' logits processors (in the order `generate()` applies them) for
the distribution, and `generate()` itself, with its cache, for the steps. The one formula here is the KV
cache's size, which the tests check against the real cache's bytes. Bad input raises `UsageError` whose
message names the field and the limit; its `field` attribute names the field for the web app.
"""

from __future__ import annotations

import base64
import json
import math
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from ...arguments import PENALTY_LIMIT
from ...errors import UsageError
from ...tokenization.viewer import _token_bytes


MAX_STEPS = 64
MAX_TOP = 100
SHOWN_DIMS = 64
CACHED_FORWARDS = 4  # the attention of the last few forwards, so that switching layer or head is a lookup
# ... and at most this many bytes of it, the latest forward's always kept (GPT-2's 12 x 12 heads at its context of
# 1024 are 604 MB a forward; the small preset's 6 x 6 at 256, 9 MB)
CACHED_BYTES = 1024 * 1024 * 1024
OVERVIEW_CELLS = 24  # each head's thumbnail: its map average-pooled to at most this many cells a side
MAX_TEMPERATURE = 100.0
# Below this, logits of float32 models divided by T overflow to inf and the softmax is not a number (1e-39 does).
MIN_TEMPERATURE = 0.01
SETTINGS = ("temperature", "top_k", "top_p", "presence_penalty", "frequency_penalty")


def refuse(field_name: str, message: str) -> UsageError:
    """A UsageError that carries the field it is about (the app answers 400 with `field` set)."""
    error = UsageError(message)
    error.field = field_name
    return error


@dataclass
class Explorer:
    """One loaded folder, switched to eager attention, and the facts every function needs; `lock` serialises
    the model calls (one request at a time)."""

    path: str
    model: object
    tokenizer: object
    kind: str  # "decoder" or "seq2seq"
    context: int
    vocab_size: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    _backend: dict | None = None  # tokenizer.json, parsed once when merges are first asked for
    # Least recently used first, at most CACHED_FORWARDS each, read and written under `lock`:
    # (ids, decoder ids) -> {kind: (L, H, Q, K) float32 weights}, and a source's ids -> its greedy translation.
    _attention: OrderedDict = field(default_factory=OrderedDict)
    _translations: OrderedDict = field(default_factory=OrderedDict)

    @classmethod
    def open(cls, folder: str, device: str = "cpu") -> Explorer:
        """The folder loaded as every command loads one (`load_folder`: safetensors only, Deriv's installed
        classes, no trust_remote_code, an adapter merged), with the eager kernel that returns attention weights."""
        from ...folder.load import load_folder

        loaded = load_folder(folder)
        model = loaded.model.to(device) if device != "cpu" else loaded.model
        model.set_attn_implementation("eager")
        model.eval()
        kind = "seq2seq" if model.config.is_encoder_decoder else "decoder"
        return cls(
            path=os.path.abspath(str(folder)),
            model=model,
            tokenizer=loaded.tokenizer,
            kind=kind,
            context=model.config.max_position_embeddings,
            vocab_size=model.config.vocab_size,
        )

    @property
    def seq2seq(self) -> bool:
        return self.kind == "seq2seq"

    @property
    def target_vocab_size(self) -> int:
        """The decoder's vocabulary: a translation model's target side may have its own."""
        return getattr(self.model.config, "decoder_vocab_size", None) or self.vocab_size

    def backend(self) -> dict:
        """The tokenizer's `tokenizers` description (tokenizer.json), or {} for a tokenizer without one (an
        imported OPUS-MT keeps its SentencePiece `MarianTokenizer`)."""
        if self._backend is None:
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            self._backend = json.loads(backend.to_str()) if backend is not None else {}
        return self._backend


# ----- facts -----


def _is_quantized(model) -> bool:
    """True for an int8 folder: `deriv quantize` leaves torchao tensor subclasses (or a quantization config)."""
    if getattr(model.config, "quantization_config", None) is not None:
        return True
    return any(type(p).__name__ != "Parameter" and type(p) is not torch.Tensor for p in model.parameters())


def _dtype_bytes(ex: Explorer) -> int:
    """Bytes per cached number: the dtype the activations (and so the cache) are in."""
    return torch.empty((), dtype=ex.model.dtype).element_size()


def _defaults(ex: Explorer) -> dict:
    """temperature, top_k and top_p as generate() would use them: the folder's generation config, else the
    library's defaults."""
    from transformers import GenerationConfig

    fallback = GenerationConfig._get_default_generation_params()
    config = ex.model.generation_config
    values = {}
    for name in ("temperature", "top_k", "top_p"):
        value = getattr(config, name, None)
        values[name] = fallback[name] if value is None else value
    return values


def _stack_facts(ex: Explorer) -> tuple[int, int]:
    """(layers, heads) of the stack that generates: the decoder."""
    config = ex.model.config
    if ex.seq2seq:
        return config.decoder_layers, config.decoder_attention_heads
    return config.num_hidden_layers, config.num_attention_heads


def _kv_heads(ex: Explorer) -> int:
    """The key/value heads the decoder caches: fewer than its heads with grouped-query attention (a translation
    model, and a folder from before the switch, have one per head)."""
    heads = _stack_facts(ex)[1]
    return getattr(ex.model.config, "num_key_value_heads", None) or heads


def _rotary(ex: Explorer) -> bool:
    return ex.model.config.position_embedding_type == "rotary"


# What the page says instead of an additive position strip, for a folder whose positions are rotary.
ROTARY_NOTE = "rotary: positions rotate q and k in each head"


def _tokenizer_kind(ex: Explorer) -> str:
    return ex.backend().get("model", {}).get("type") or type(ex.tokenizer).__name__


def info(ex: Explorer) -> dict:
    config = ex.model.config
    layers, heads = _stack_facts(ex)
    scale = _token_embedding(ex).embed_scale
    facts = {
        "name": os.path.basename(ex.path.rstrip(os.sep)),
        "kind": ex.kind,
        "model_type": config.model_type,
        "layers": layers,
        "heads": heads,
        "kv_heads": _kv_heads(ex),
        "hidden_size": config.hidden_size,
        "head_dim": config.hidden_size // heads,
        "vocab_size": ex.vocab_size,
        "context": ex.context,
        "position_type": config.position_embedding_type,
        "embed_scale": float(scale),
        "pre_norm": bool(config.pre_norm),
        "norm_type": getattr(config, "norm_type", "layer_norm"),
        "gated_mlp": bool(getattr(config, "gated_mlp", False)),
        "bias": bool(getattr(config, "bias", True)),
        "activation": config.hidden_act,
        "dtype": str(ex.model.dtype).removeprefix("torch."),
        "quantized": _is_quantized(ex.model),
        "tokenizer": _tokenizer_kind(ex),
        "defaults": _defaults(ex),
    }
    if ex.seq2seq:
        facts["encoder_layers"] = config.encoder_layers
        facts["decoder_layers"] = config.decoder_layers
    if _rotary(ex):
        facts["rope_theta"] = float(config.rope_theta)
    return facts


# ----- inputs -----


def _check_ids(ids, field_name: str, vocab: int) -> list[int]:
    if not isinstance(ids, list | tuple):
        raise refuse(field_name, f"{field_name} should be a list of token ids")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise refuse(field_name, f"{field_name} holds {i!r}, not a token id (an integer)")
        if not 0 <= i < vocab:
            raise refuse(field_name, f"{field_name} holds {i}; token ids run from 0 to {vocab - 1}")
    return list(ids)


def _encode(ex: Explorer, text, field_name: str) -> list[int]:
    """The ids of a source text, or of a target one (`field_name` "target": through `text_target`, so a tokenizer
    with a target side of its own, OPUS-MT's, uses it)."""
    if not isinstance(text, str):
        raise refuse(field_name, f"{field_name} should be a string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\ud800") is valid JSON, but no text a tokenizer takes
        raise refuse(field_name, f"{field_name} holds a lone surrogate, not a character (invalid UTF-16)") from None
    if field_name == "target":
        return ex.tokenizer(text_target=text, add_special_tokens=False).input_ids
    return ex.tokenizer(text, add_special_tokens=False).input_ids


def _one_side(ex: Explorer, inputs: dict, text_key: str, ids_key: str, vocab: int, limit: int) -> list[int] | None:
    """The ids of one side (`text` or `ids`; `target` or `target_ids`), checked; None when neither is given."""
    text, ids = inputs.get(text_key), inputs.get(ids_key)
    if text is not None and ids is not None:
        raise refuse(ids_key, f"give {text_key} or {ids_key}, not both")
    if text is None and ids is None:
        return None
    field_name = text_key if text is not None else ids_key
    tokens = _encode(ex, text, text_key) if text is not None else _check_ids(ids, ids_key, vocab)
    if len(tokens) > limit:
        given = f"the {text_key} is" if field_name == text_key else f"{ids_key} holds"
        room = "its context" if text_key == "text" else "its context, less the decoder's start token"
        raise refuse(field_name, f"{given} {len(tokens)} tokens; this model reads at most {limit} ({room})")
    return tokens


@dataclass
class Inputs:
    """Checked ids: the text (a translation model's source), and for a translation model the decoder's input,
    beginning with its start token."""

    ids: list[int]
    decoder_ids: list[int] | None = None


def remember(memo: OrderedDict, key, value, size=lambda value: 0) -> None:
    """`memo[key] = value` as its most recent entry, the oldest dropped past CACHED_FORWARDS entries or past
    CACHED_BYTES in all (`size` of each value), the newest always kept."""
    memo[key] = value
    memo.move_to_end(key)
    while len(memo) > CACHED_FORWARDS or (len(memo) > 1 and sum(map(size, memo.values())) > CACHED_BYTES):
        memo.popitem(last=False)


def recall(memo: OrderedDict, key):
    """`memo[key]`, now the most recent entry, or None."""
    if key not in memo:
        return None
    memo.move_to_end(key)
    return memo[key]


def _inputs(ex: Explorer, inputs: dict) -> Inputs:
    """`inputs` checked: exactly one of text/ids, within the vocabulary and the context, not empty. A translation
    model's target (`target`/`target_ids`, without the start token) may be empty; when neither is given it is
    the model's own greedy translation of the source."""
    if not isinstance(inputs, dict):
        raise refuse("text", "the inputs should be an object with text or ids")
    allowed = {"text", "ids"} | ({"target", "target_ids"} if ex.seq2seq else set())
    for key in inputs:
        if key not in allowed:
            raise refuse(key, f"{key} is not an input here (expected: {', '.join(sorted(allowed))})")
    ids = _one_side(ex, inputs, "text", "ids", ex.vocab_size, ex.context)
    if ids is None:
        raise refuse("text", "give text or ids")
    if not ids:
        raise refuse("text" if "text" in inputs else "ids", f"the {'text' if 'text' in inputs else 'ids'} is empty")
    if not ex.seq2seq:
        return Inputs(ids)
    start = ex.model.config.decoder_start_token_id
    target = _one_side(ex, inputs, "target", "target_ids", ex.target_vocab_size, ex.context - 1)
    if target is None:
        return Inputs(ids, _greedy_translation(ex, ids))
    return Inputs(ids, [start] + target)


@torch.no_grad()
def _greedy_translation(ex: Explorer, ids: list[int]) -> list[int]:
    """The decoder's input for the model's own greedy translation (start token first), as
    `viz.attention.attention_maps` makes it, without the end-of-sequence token that closed it: the page then shows
    the translation's alignment, and the next token's distribution at its last position (where the model ends
    it), from which greedy and sample go on as `generate()` would."""
    source = torch.tensor([ids], device=ex.model.device)
    with ex.lock:
        known = recall(ex._translations, tuple(ids))  # subtle: a switch of layer or head asks for it again
        if known is not None:
            return list(known)
        generated = ex.model.generate(input_ids=source, num_beams=1, do_sample=False, max_new_tokens=ex.context - 1)
        decoder_ids = generated[0].tolist()
        eos = ex.model.generation_config.eos_token_id
        eos = {eos} if isinstance(eos, int) else set(eos or ())
        if len(decoder_ids) > 1 and decoder_ids[-1] in eos:
            decoder_ids.pop()
        remember(ex._translations, tuple(ids), tuple(decoder_ids))
    return decoder_ids


def _token(ex: Explorer, token_id: int) -> dict:
    raw = ex.tokenizer.convert_ids_to_tokens(token_id)
    special = token_id in set(ex.tokenizer.all_special_ids)
    if raw is None:  # a row of the embedding past the tokenizer's vocabulary (padded to a round size)
        raw, special = f"<id {token_id}>", True
    return {"id": token_id, "piece": _piece(ex, raw, special), "raw": raw, "special": special}


def _piece(ex: Explorer, raw: str | None, special: bool) -> str:
    """The text a token stands for: a byte-level piece's bytes as UTF-8 (U+FFFD for a partial character); a
    SentencePiece piece with its '▁' as the space it stands for."""
    if raw is None:
        return ""
    if special:
        return raw
    if _byte_level(ex):
        return _token_bytes(raw).decode("utf-8", errors="replace")
    return raw.replace("\u2581", " ")


def _byte_level(ex: Explorer) -> bool:
    decoder = ex.backend().get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", []) or []]
    return "ByteLevel" in kinds


# ----- settings and the logits processors -----


def _number(settings: dict, name: str, default, lowest, highest, low_open: bool = False):
    value = settings.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise refuse(name, f"{name} should be a number, not {value!r}")
    below = value <= lowest if low_open else value < lowest
    if below or value > highest:
        opening = "(" if low_open else "["
        raise refuse(name, f"{name} is {value}; it should be in {opening}{lowest}, {highest}]")
    return value


def check_settings(ex: Explorer, settings: dict | None) -> dict:
    """The sampling settings, each checked and defaulted (temperature, top_k and top_p: the folder's generation
    config, as generate() would use them; the penalties: 0)."""
    settings = {} if settings is None else settings
    if not isinstance(settings, dict):
        raise refuse("settings", "settings should be an object")
    for key in settings:
        if key not in SETTINGS:
            raise refuse(key, f"{key} is not a setting (expected: {', '.join(SETTINGS)})")
    defaults = _defaults(ex)
    top_k = settings.get("top_k", defaults["top_k"])
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise refuse("top_k", f"top_k is {top_k!r}; it should be a whole number >= 0 (0 keeps every token)")
    return {
        "temperature": float(
            _number(settings, "temperature", defaults["temperature"], MIN_TEMPERATURE, MAX_TEMPERATURE)
        ),
        "top_k": top_k,
        "top_p": float(_number(settings, "top_p", defaults["top_p"], 0, 1, True)),
        "presence_penalty": float(_number(settings, "presence_penalty", 0.0, -PENALTY_LIMIT, PENALTY_LIMIT)),
        "frequency_penalty": float(_number(settings, "frequency_penalty", 0.0, -PENALTY_LIMIT, PENALTY_LIMIT)),
    }


def _user_processors(settings: dict) -> list:
    """The penalties, which generate() takes as a user's `logits_processor` list."""
    from ...modeling_deriv.decode_loop import penalty_processors  # the rule, stated once

    return list(penalty_processors(settings["presence_penalty"], settings["frequency_penalty"]))


def _folder_processors(ex: Explorer) -> list[tuple[str, object]]:
    """The processors the folder's generation config adds in generate(), in its order: a repetition penalty
    (Deriv's trained folders have 1.1), a no-repeat n-gram size, bad words (an imported OPUS-MT's pad token).
    subtle: the ones tied to a length limit (min_length, forced BOS/EOS) are left out: the explorer shows the
    next token of a sequence that may go on, not the last one before max_length."""
    from transformers import NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

    config = ex.model.generation_config
    named = []
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        penalty = config.repetition_penalty
        named.append((f"RepetitionPenaltyLogitsProcessor({penalty:g})", RepetitionPenaltyLogitsProcessor(penalty)))
    if config.no_repeat_ngram_size:
        size = config.no_repeat_ngram_size
        named.append((f"NoRepeatNGramLogitsProcessor({size})", NoRepeatNGramLogitsProcessor(size)))
    if config.bad_words_ids is not None:
        eos = config.eos_token_id
        processor = NoBadWordsLogitsProcessor(config.bad_words_ids, eos)
        named.append((f"NoBadWordsLogitsProcessor({config.bad_words_ids})", processor))
    return named


def sampling_processors(ex: Explorer, settings: dict) -> list[tuple[str, object]]:
    """(name, processor) in the order generate(do_sample=True) applies them (`_get_logits_processor`): the
    folder's own processors (`_folder_processors`), then the user's list (the penalties), then the warpers
    temperature, top-k and top-p, each only where it changes something (as generate() skips them)."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    named = _folder_processors(ex)
    for processor in _user_processors(settings):
        value = getattr(processor, "presence_penalty", None) or getattr(processor, "frequency_penalty", None)
        named.append((f"{type(processor).__name__}({value:g})", processor))
    if settings["temperature"] != 1.0:
        named.append(
            (f"TemperatureLogitsWarper({settings['temperature']:g})", TemperatureLogitsWarper(settings["temperature"]))
        )
    if settings["top_k"] != 0:
        named.append(
            (f"TopKLogitsWarper({settings['top_k']})", TopKLogitsWarper(top_k=settings["top_k"], min_tokens_to_keep=1))
        )
    if settings["top_p"] < 1.0:
        named.append(
            (
                f"TopPLogitsWarper({settings['top_p']:g})",
                TopPLogitsWarper(top_p=settings["top_p"], min_tokens_to_keep=1),
            )
        )
    return named


def _check_top(top) -> int:
    if isinstance(top, bool) or not isinstance(top, int) or not 1 <= top <= MAX_TOP:
        raise refuse("top", f"top is {top!r}; it should be a whole number from 1 to {MAX_TOP}")
    return top


# ----- the forward pass -----


def _forward(ex: Explorer, checked: Inputs):
    """One forward pass with the attention weights; the logits of the last position are what generate() would
    score first."""
    device = ex.model.device
    source = torch.tensor([checked.ids], device=device)
    if not ex.seq2seq:
        return ex.model(input_ids=source, output_attentions=True, use_cache=False)
    return ex.model(
        input_ids=source,
        decoder_input_ids=torch.tensor([checked.decoder_ids], device=device),
        output_attentions=True,
        use_cache=False,
    )


def _distribution(ex: Explorer, history: list[int], logits: torch.Tensor, settings: dict, top: int) -> dict:
    """NEXT: the candidates under the processors, applied as generate() applies them to its first step."""
    logits = logits.float().reshape(1, -1)
    input_ids = torch.tensor([history], device=logits.device)
    scores = logits.clone()
    named = sampling_processors(ex, settings)
    for _, processor in named:
        scores = processor(input_ids, scores)
    probabilities = torch.softmax(scores, dim=-1)[0]
    base = torch.softmax(logits, dim=-1)[0]
    # subtle: a stable sort keeps equal probabilities (the zeros past a cut) in id order
    order = torch.sort(probabilities, descending=True, stable=True).indices[:top].tolist()
    candidates = []
    for i in order:
        score = scores[0, i].item()
        candidates.append(
            {
                **{k: v for k, v in _token(ex, i).items() if k != "special"},
                "logit": logits[0, i].item(),
                "score": score if math.isfinite(score) else None,
                "probability": probabilities[i].item(),
                "base_probability": base[i].item(),
            }
        )
    positive = probabilities[probabilities > 0]
    return {
        "candidates": candidates,
        "kept": int(positive.numel()),
        "vocab_size": int(probabilities.numel()),
        "entropy": abs(float((positive * positive.log()).sum().item())),  # abs: one kept token gives 0, not -0.0
        "processors": [name for name, _ in named],
    }


def _history(checked: Inputs) -> list[int]:
    """The ids generate() hands its processors: the prompt, or a translation model's decoder input."""
    return checked.decoder_ids if checked.decoder_ids is not None else checked.ids


@torch.no_grad()
def next_token(ex: Explorer, inputs: dict, settings: dict | None = None, top: int = 10) -> dict:
    checked, settings, top = _inputs(ex, inputs), check_settings(ex, settings), _check_top(top)
    with ex.lock:
        out = _forward(ex, checked)
    return _distribution(ex, _history(checked), out.logits[0, -1], settings, top)


# ----- analyze: tokens, embeddings, attention -----


def encode(t: torch.Tensor, dtype: str = "float32") -> dict:
    """An array as {"shape", "dtype", "data": base64 of its bytes, little-endian, row-major}: the page reads it
    with a typed array (Float32Array, Uint8Array), so a float32 arrives as exactly the model's value."""
    array = np.ascontiguousarray(t.detach().cpu().numpy(), dtype="<f4" if dtype == "float32" else dtype)
    return {"shape": list(array.shape), "dtype": dtype, "data": base64.b64encode(array.tobytes()).decode("ascii")}


def decode(encoded: dict) -> torch.Tensor:
    """`encode`'s array back as a tensor (for Python clients and the tests)."""
    dtype = "<f4" if encoded["dtype"] == "float32" else encoded["dtype"]
    array = np.frombuffer(base64.b64decode(encoded["data"]), dtype=dtype).reshape(encoded["shape"])
    return torch.from_numpy(array.copy())


def _token_embedding(ex: Explorer):
    stack = ex.model.model.encoder if ex.seq2seq else ex.model.model
    return stack.embed_tokens


def _embeddings(ex: Explorer, ids: list[int]) -> dict:
    """The first layer's input, in its two parts: the (scaled) token vectors and the positions' vectors, looked
    up by the model's own embedding modules (the encoder's, for a translation model). The three [tokens][dims]
    arrays are `encode`d: at a full context of the small preset they were 1 MB as decimal JSON. Rotary positions
    add nothing to the input (they turn q and k in every layer): no `position`, the sum is the token vectors,
    and `position_note` says where the positions went."""
    stack = ex.model.model.encoder if ex.seq2seq else ex.model.model
    device = ex.model.device
    token = stack.embed_tokens(torch.tensor([ids], device=device))[0].float()
    parts = {"token": token}
    if not _rotary(ex):
        parts["position"] = stack.embed_positions(torch.arange(len(ids), device=device).unsqueeze(0))[0].float()
    parts["sum"] = sum(parts.values())
    shown = min(ex.model.config.hidden_size, SHOWN_DIMS)
    facts = {
        "hidden_size": ex.model.config.hidden_size,
        "dims": shown,
        "position_type": ex.model.config.position_embedding_type,
        "embed_scale": float(stack.embed_tokens.embed_scale),
        **{name: encode(t[:, :shown]) for name, t in parts.items()},
        "norms": {name: t.norm(dim=-1).tolist() for name, t in parts.items()},
    }
    if _rotary(ex):
        facts["position_note"] = ROTARY_NOTE
    return facts


# kind -> (query side, key side, causal), in the order the page offers them: the first is the one shown first,
# a translation model's cross-attention (the alignment is what a person opens one for).
LM_KINDS = {"decoder": ("text", "text", True)}
SEQ2SEQ_KINDS = {
    "cross": ("target", "source", False),
    "encoder": ("source", "source", False),
    "decoder": ("target", "target", True),
}


def _kinds(ex: Explorer) -> dict:
    return SEQ2SEQ_KINDS if ex.seq2seq else LM_KINDS


def _weights(ex: Explorer, out) -> dict[str, torch.Tensor]:
    """Each kind's (L, H, Q, K) float32 weights from the forward's `output_attentions`."""
    if ex.seq2seq:
        named = {"cross": out.cross_attentions, "encoder": out.encoder_attentions, "decoder": out.decoder_attentions}
    else:
        named = {"decoder": out.attentions}
    return {kind: torch.stack(weights)[:, 0].float().contiguous() for kind, weights in named.items()}


def _key(checked: Inputs) -> tuple:
    return tuple(checked.ids), None if checked.decoder_ids is None else tuple(checked.decoder_ids)


def _keep_weights(ex: Explorer, checked: Inputs, weights: dict[str, torch.Tensor]) -> None:
    def size(kinds: dict[str, torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in kinds.values())

    remember(ex._attention, _key(checked), weights, size)


def _overview(weights: torch.Tensor) -> dict:
    """Every head's map average-pooled to at most OVERVIEW_CELLS a side (exact where a map is smaller), as uint8
    0..255 of the pooled weight times 255: for drawing thumbnails only; the numbers are the selected map's."""
    layers, heads, queries, keys = weights.shape
    size = (min(queries, OVERVIEW_CELLS), min(keys, OVERVIEW_CELLS))
    pooled = torch.nn.functional.adaptive_avg_pool2d(weights.reshape(layers * heads, queries, keys), size)
    cells = torch.round(pooled.clamp(0, 1) * 255).to(torch.uint8).reshape(layers, heads, *size)
    return {**encode(cells, "uint8"), "scale": 255}


def _maps(ex: Explorer, weights: dict[str, torch.Tensor]) -> dict:
    """Per kind, the facts of its maps and the overview of every layer and head (no single map's weights)."""
    maps = {}
    for kind, (query_side, key_side, causal) in _kinds(ex).items():
        layers, heads, queries, keys = weights[kind].shape
        maps[kind] = {
            "layers": layers,
            "heads": heads,
            "queries": queries,
            "keys": keys,
            "query_side": query_side,
            "key_side": key_side,
            "causal": causal,
            "overview": _overview(weights[kind]),
        }
    return maps


def _check_view(ex: Explorer, view, prefix: str = "") -> tuple[str, int, int]:
    """(kind, layer, head) checked against the folder's maps; left out: the first kind, layer 0, head 0.
    subtle: every kind of a stack has its own layer count (a translation model's encoder and decoder may differ)."""
    view = {} if view is None else view
    if not isinstance(view, dict):
        raise refuse(prefix.rstrip(".") or "view", f"{prefix.rstrip('.') or 'view'} should be an object")
    for key in view:
        if key not in ("kind", "layer", "head"):
            raise refuse(prefix + key, f"{prefix}{key} is not part of a view (expected: kind, layer, head)")
    kinds = _kinds(ex)
    kind = view.get("kind") if view.get("kind") is not None else next(iter(kinds))
    if kind not in kinds:
        raise refuse(prefix + "kind", f"{prefix}kind is {kind!r}; this folder has {', '.join(map(repr, kinds))}")
    config = ex.model.config
    if ex.seq2seq:
        layers = config.encoder_layers if kind == "encoder" else config.decoder_layers
        heads = config.encoder_attention_heads if kind == "encoder" else config.decoder_attention_heads
    else:
        layers, heads = config.num_hidden_layers, config.num_attention_heads
    picked = []
    for name, count in (("layer", layers), ("head", heads)):
        value = view.get(name) if view.get(name) is not None else 0
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
            raise refuse(prefix + name, f"{prefix}{name} is {value!r}; {kind} has {name}s 0 to {count - 1}")
        picked.append(value)
    return kind, picked[0], picked[1]


def _one_map(weights: dict[str, torch.Tensor], kind: str, layer: int, head: int) -> dict:
    return {"kind": kind, "layer": layer, "head": head, "weights": encode(weights[kind][layer, head])}


@torch.no_grad()
def analyze(ex: Explorer, inputs: dict, settings: dict | None = None, top: int = 10, view: dict | None = None) -> dict:
    """Tokens, embeddings, per attention kind its facts and overview, the one map `view` names (its float32
    weights), and the next token's distribution: one forward pass, whose attention is kept for `attention`."""
    started = time.perf_counter()
    settings, top = check_settings(ex, settings), _check_top(top)
    kind, layer, head = _check_view(ex, view, "view.")
    checked = _inputs(ex, inputs)  # last: a translation model's missing target is a greedy translation
    with ex.lock:
        out = _forward(ex, checked)
        weights = _weights(ex, out)
        _keep_weights(ex, checked, weights)
        embeddings = _embeddings(ex, checked.ids)
    result = {"tokens": [_token(ex, i) for i in checked.ids]}
    if ex.seq2seq:
        result["target_tokens"] = [_token(ex, i) for i in checked.decoder_ids]
    result["attention"] = _maps(ex, weights)
    result["view"] = _one_map(weights, kind, layer, head)
    result["embeddings"] = embeddings
    result["next"] = _distribution(ex, _history(checked), out.logits[0, -1], settings, top)
    result["seconds"] = time.perf_counter() - started
    return result


@torch.no_grad()
def attention(ex: Explorer, inputs: dict, kind=None, layer=None, head=None) -> dict:
    """One map's float32 weights, as analyze's `view`: from the attention of the last few forwards when these
    inputs were among them (switching layer or head is then a lookup), else by the same forward analyze runs."""
    started = time.perf_counter()
    checked = _inputs(ex, inputs)
    kind, layer, head = _check_view(ex, {"kind": kind, "layer": layer, "head": head})
    with ex.lock:
        weights = recall(ex._attention, _key(checked))
        if weights is None:
            weights = _weights(ex, _forward(ex, checked))
            _keep_weights(ex, checked, weights)
    return {**_one_map(weights, kind, layer, head), "seconds": time.perf_counter() - started}


# ----- generation, step by step -----


class _StepClock:
    """A logits processor that changes nothing and notes when each step's scores arrive: generate() calls it
    once per step, right after that step's forward pass."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def _check_steps(mode, steps, seed) -> None:
    if mode not in ("greedy", "sample"):
        raise refuse("mode", f"mode is {mode!r}; it should be 'greedy' or 'sample'")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise refuse("seed", f"seed is {seed!r}; it should be a whole number from 0 to {2**32 - 1}")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise refuse("steps", f"steps is {steps!r}; it should be a whole number from 1 to {MAX_STEPS}")


def _check_room(ex: Explorer, checked: Inputs, steps: int) -> None:
    used = len(_history(checked))
    room = ex.context - used
    if steps > room:
        raise refuse(
            "steps",
            f"steps is {steps}; {used} of the context's {ex.context} positions are used, so at most {room} more",
        )


def cache_tensors(cache) -> list[torch.Tensor]:
    """Every key and value tensor a cache holds (both caches of an encoder-decoder one)."""
    if cache is None:
        return []
    if hasattr(cache, "self_attention_cache"):
        return cache_tensors(cache.self_attention_cache) + cache_tensors(cache.cross_attention_cache)
    tensors = []
    for layer in cache.layers:
        tensors += [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None]
    return tensors


def returned_cache(out):
    """The cache generate() returns: `cache` from transformers 5.24, `past_key_values` before (reading the old
    name on 5.24 warns)."""
    return out["cache"] if "cache" in out else out.get("past_key_values")


def _cache_facts(ex: Explorer, checked: Inputs) -> tuple[int, int, str]:
    """(bytes per position of the self-attention cache, bytes of a translation model's cross-attention cache,
    the formula): keys and values, for every layer and key/value head of the decoder (with grouped-query
    attention the cache holds the kv heads un-repeated, so fewer than the heads)."""
    layers, heads = _stack_facts(ex)
    kv_heads = _kv_heads(ex)
    head_dim = ex.model.config.hidden_size // heads
    width = _dtype_bytes(ex)
    per_token = 2 * layers * kv_heads * head_dim * width
    formula = "2 x layers x kv_heads x head_dim x positions x bytes"
    formula += f" = 2 x {layers} x {kv_heads} x {head_dim} x positions x {width}"
    if not ex.seq2seq:
        return per_token, 0, formula
    source = len(checked.ids)
    cross = per_token * source  # cross-attention keys and values: one per source position, computed once
    return per_token, cross, formula + f" (+ cross-attention: the same per source position, x {source})"


def _run_generate(ex: Explorer, checked: Inputs, settings: dict, mode: str, seed: int, steps: int, clock):
    """generate() itself: greedy, or sampling with the settings after torch.manual_seed(seed)."""
    device = ex.model.device
    source = torch.tensor([checked.ids], device=device)
    options = {
        "max_new_tokens": steps,
        "num_beams": 1,
        "output_scores": True,
        "return_dict_in_generate": True,
        "logits_processor": [*_user_processors(settings), clock],
        "attention_mask": torch.ones_like(source),
        # subtle: the processors tied to a length are off, as in next_token: OPUS-MT's forced_eos_token_id would
        # force </s> at the last of `steps` (so one step at a time would always end the translation)
        "forced_eos_token_id": None,
        "min_length": 0,
        "min_new_tokens": None,
    }
    if mode == "sample":
        options.update(
            do_sample=True, temperature=settings["temperature"], top_k=settings["top_k"], top_p=settings["top_p"]
        )
    else:
        options.update(do_sample=False)
    if ex.seq2seq:
        options["decoder_input_ids"] = torch.tensor([checked.decoder_ids], device=device)
    torch.manual_seed(seed)
    return ex.model.generate(input_ids=source, **options)


@torch.no_grad()
def generate_steps(
    ex: Explorer, inputs: dict, settings: dict | None = None, mode: str = "greedy", steps: int = 3, seed: int = 0
) -> dict:
    """A few tokens through generate() (its cache, its processors), with each step's token, its probability
    under generate's processed scores, the cache's size then, and the time of the prefill and of each decode."""
    settings = check_settings(ex, settings)
    _check_steps(mode, steps, seed)
    checked = _inputs(ex, inputs)  # after the cheap checks: a translation model's missing target is a translation
    _check_room(ex, checked, steps)
    clock = _StepClock()
    with ex.lock:
        started = time.perf_counter()
        out = _run_generate(ex, checked, settings, mode, seed, steps, clock)
    history = _history(checked)
    sequence = out.sequences[0].tolist()
    new = sequence[len(history) :] if ex.seq2seq else sequence[len(checked.ids) :]
    per_token, cross, formula = _cache_facts(ex, checked)
    times = [started] + clock.times
    rows = []
    for k, token_id in enumerate(new):
        probability = torch.softmax(out.scores[k][0].float(), dim=-1)[token_id].item()
        positions = len(history) + k  # the cache after step k's forward: the input and the k tokens fed back
        rows.append(
            {
                **{key: v for key, v in _token(ex, token_id).items() if key != "special"},
                "probability": probability,
                "phase": "prefill" if k == 0 else "decode",
                "seconds": times[k + 1] - times[k],
                "cache_positions": positions,
                "cache_bytes": per_token * positions + cross,
            }
        )
    final = cache_tensors(returned_cache(out))
    ids = sequence[1:] if ex.seq2seq else sequence
    decode = [r["seconds"] for r in rows[1:]]
    eos = ex.model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    return {
        "steps": rows,
        "ids": ids,
        "text": ex.tokenizer.decode(ids, skip_special_tokens=False),
        "cache": {
            "formula": formula,
            "per_token_bytes": per_token,
            "cross_bytes": cross,
            "final_bytes": sum(t.numel() * t.element_size() for t in final),
        },
        "prefill_seconds": rows[0]["seconds"] if rows else 0.0,
        "decode_seconds_mean": sum(decode) / len(decode) if decode else None,
        "finished": bool(new) and new[-1] in eos,
    }


# ----- merges -----


def _merge_ranks(ex: Explorer) -> dict[str, tuple[int, str, str]]:
    """merged token -> (rank, left, right) of the lowest-rank merge that makes it."""
    ranks: dict[str, tuple[int, str, str]] = {}
    for rank, merge in enumerate(ex.backend()["model"].get("merges") or []):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        ranks.setdefault(left + right, (rank, left, right))
    return ranks


def _tree(ex: Explorer, raw: str, ranks: dict) -> dict:
    made = ranks.get(raw)
    node = {"raw": raw, "piece": _piece(ex, raw, False), "rank": None, "left": None, "right": None}
    if made is not None:
        rank, left, right = made
        node.update(rank=rank, left=_tree(ex, left, ranks), right=_tree(ex, right, ranks))
    return node


def merges(ex: Explorer, token_id) -> dict:
    """The BPE merges that built a token, from the folder's tokenizer.json: the lowest-rank merge whose two parts
    concatenate to it, and recursively its parts, down to single symbols (bytes)."""
    if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < len(ex.tokenizer):
        raise refuse("id", f"id is {token_id!r}; token ids run from 0 to {len(ex.tokenizer) - 1}")
    token = _token(ex, token_id)
    result = {"id": token_id, "piece": token["piece"], "raw": token["raw"]}
    leaf = {"raw": token["raw"], "piece": token["piece"], "rank": None, "left": None, "right": None}
    model_type = ex.backend().get("model", {}).get("type")
    if token["special"]:
        return {**result, "kind": "special", "tree": leaf}
    if model_type != "BPE":
        message = f"this tokenizer is {model_type or 'not BPE'}, which has no merges"
        return {**result, "kind": "unknown", "tree": leaf, "message": message}
    ranks = _merge_ranks(ex)
    if token["raw"] not in ranks:
        return {**result, "kind": "byte", "tree": leaf}
    return {**result, "kind": "merged", "tree": _tree(ex, token["raw"], ranks)}
