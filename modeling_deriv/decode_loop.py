"""Batch-1 decode near the hardware: one compiled step (forward, logits processors, token choice) per token.

    model.generate(ids, max_new_tokens=256, decode_loop="compiled")          # Deriv's switch
    model.generate(ids, max_new_tokens=256, custom_generate=decode_loop)     # transformers' hook, the same loop
    model.generation_config.decode_loop = "compiled"                          # every generate() of this model

Why a loop of our own: `generate()` runs Python between forwards on every token: it grows the id tensor and the
mask, calls each logits processor and stopping criterion, and reads flags back from the device. With a static cache
transformers compiles the forward alone, so each token is still one graph plus dozens of small launches and a few
host synchronisations. Here everything a step does lives in one function, compiled once (CUDA graphs on a GPU,
`mode="reduce-overhead"`), whose inputs and outputs are tensors of fixed shape:

    token (B, 1), position (B, 1), alive (B,), slot (1,), settings  ->  forward over the static cache
                                                                    ->  penalties, warpers (from `settings`)
                                                                    ->  argmax, or a sample
                                                                    ->  next token, next position, alive, slot + 1

The sampling settings (temperature, top-k, top-p, min-p, the repetition, presence and frequency penalties) are
inputs of that function, tensors of one shape whatever their values (`Settings`), never constants of the graph: one
compiled step serves every request, as vLLM keeps its sampling parameters in tensors. (Before, the step ran
transformers' processors, whose settings the compiler read as constants: each new temperature compiled the step
again, and after torch's recompile limit, eight, every new setting failed.) The step applies them as transformers'
processors do, operation for operation (`penalise`, `warp`, tested against them), with top-k as data: the k-th
largest score is gathered from the sorted scores, so k is a value, not a shape. A setting at its neutral value
(temperature 1, top-k off, top-p 1, penalties 1 or 0) leaves the scores as they are, so the settings a request
leaves out cost nothing but the arithmetic. What still compiles the step again is a new shape (a batch size, a cache
capacity), greedy search against sampling (and greedy with penalties against without), and a dtype; past torch's
recompile limit such a call runs the same step uncompiled, said once in the log (`run_steps`), so the limit never
stops the loop.

The host reads nothing back per token: the end-of-sequence test runs on the device (`alive`), and the host asks
whether any row is still alive only every `check_every` tokens. Tokens after a row's end are `pad_token_id`, and
the output is cut where the last row ended, so the result is `generate()`'s: the same tokens for greedy search, the
same distribution for sampling (drawn as argmax(p / E) with E ~ Exp(1), the exponential race, which samples from p
exactly and, unlike `torch.multinomial`, can live inside a CUDA graph; the random numbers differ from
`generate()`'s).

What it runs is narrower than `generate()`, and it says so instead of differing silently: greedy search and
sampling (no beams, no assistant), the processors in `SUPPORTED_PROCESSORS` in generate()'s order, stopping at
`max_new_tokens` and at end-of-sequence, decoder-only models, ids as input, and no per-step outputs (scores,
attentions). The sequence the penalties see is a buffer of fixed length: the prompt and the tokens so far; the slots
not yet written (and a prompt's padding the repetition penalty is told to skip) are counted for no token.
`decode_loop="eager"` runs the same step uncompiled: the loop's logic without the compiler, for tests and where
torch.compile is not available.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import GenerationConfig, StaticCache
from transformers.generation import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.utils import logging

from .logits_process import FrequencyPenaltyLogitsProcessor, PresencePenaltyLogitsProcessor


logger = logging.get_logger(__name__)

LOOPS = ("compiled", "eager")
# processors whose result depends on the multiset of ids in the sequence at most, never on their order, in the order
# generate() applies them (its penalties, the caller's, then the warpers when sampling): the step's order
SUPPORTED_PROCESSORS = (
    RepetitionPenaltyLogitsProcessor,
    PresencePenaltyLogitsProcessor,
    FrequencyPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
)
WARPERS = SUPPORTED_PROCESSORS[3:]
CHECK_EVERY = 16  # tokens between two host reads of "is any row still going?"
CACHE_ROUNDING = 256  # cache capacities are rounded up to this, so that nearby lengths share one compiled step


class DecodeLoopUnsupported(ValueError):
    """The request asks for something the decode loop does not do; `generate()` without `decode_loop` does."""


def check_loop_name(name: str | None) -> str | None:
    if name is not None and name not in LOOPS:
        raise ValueError(f"`decode_loop` must be one of {LOOPS} or None (generate()'s own loop), got {name!r}.")
    return name


def unsupported(what: str) -> DecodeLoopUnsupported:
    return DecodeLoopUnsupported(
        f"decode_loop does not support {what}; it runs greedy search and sampling with temperature, top-k, top-p, "
        "min-p, repetition, presence and frequency penalties. Leave decode_loop unset to use generate()'s own loop."
    )


def check_request(model, generation_config: GenerationConfig, processors, criteria, model_kwargs: dict) -> None:
    """Refuse, by name, everything the loop would not reproduce exactly."""
    if model.config.is_encoder_decoder:
        raise unsupported("encoder-decoder models")
    mode = generation_config.get_generation_mode().value
    if generation_config.num_beams > 1 or mode not in ("greedy_search", "sample"):
        raise unsupported(f"the generation mode {mode!r}")
    for flag in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if generation_config.return_dict_in_generate and getattr(generation_config, flag, False):
            raise unsupported(f"{flag}=True (per-step outputs)")
    check_processors(processors)
    for criterion in criteria:
        if not isinstance(criterion, (MaxLengthCriteria, EosTokenCriteria)) and not checked_every_block(criterion):
            raise unsupported(f"the stopping criterion {type(criterion).__name__}")
    if model_kwargs.get("inputs_embeds") is not None:
        raise unsupported("inputs_embeds (pass input_ids)")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and getattr(cache, "_is_user_defined", False):
        raise unsupported("a cache passed in by the caller")


def check_processors(processors) -> None:
    """Each processor one the step applies (its own class, not a subclass that may compute something else), once
    each, in the step's order (generate()'s), and masking with -inf as the step does."""
    for processor in processors:
        if type(processor) not in SUPPORTED_PROCESSORS:
            raise unsupported(f"the logits processor {type(processor).__name__}")
        if getattr(processor, "filter_value", -float("inf")) != -float("inf"):
            raise unsupported(f"{type(processor).__name__} with a filter_value other than -inf")
    places = [SUPPORTED_PROCESSORS.index(type(processor)) for processor in processors]
    if places != sorted(set(places)):
        names = ", ".join(type(p).__name__ for p in processors)
        order = ", ".join(kind.__name__ for kind in SUPPORTED_PROCESSORS)
        raise unsupported(f"the logits processors {names} in this order (each at most once, in the order {order})")


def penalty_processors(presence: float = 0.0, frequency: float = 0.0) -> LogitsProcessorList:
    """The OpenAI API's presence and frequency penalties as the processors a caller gives generate(), each only when
    it is not 0, in the step's order: the one statement of the rule `deriv generate`, `chat`, `serve` and `explore`
    follow, so what any of them passes this loop runs."""
    values = {PresencePenaltyLogitsProcessor: presence, FrequencyPenaltyLogitsProcessor: frequency}
    return LogitsProcessorList(kind(values[kind]) for kind in SUPPORTED_PROCESSORS if values.get(kind))


def checked_every_block(criterion) -> bool:
    """A stopping criterion that ends the whole request from the host (a client that left, a deadline) says so with
    `checked_every_block = True`; the loop asks it every CHECK_EVERY tokens instead of every token."""
    return getattr(criterion, "checked_every_block", False)


class Settings(NamedTuple):
    """A request's sampling settings, each a (B, 1) tensor: inputs of the compiled step, so that no value of theirs
    is a constant of its graph. Each field's neutral value (the processor absent) leaves the scores as they are."""

    repetition: torch.Tensor  # float, 1: RepetitionPenaltyLogitsProcessor's penalty
    presence: torch.Tensor  # float, 0: PresencePenaltyLogitsProcessor's
    frequency: torch.Tensor  # float, 0: FrequencyPenaltyLogitsProcessor's
    temperature: torch.Tensor  # float, 1
    top_p_floor: torch.Tensor  # float, -1: 1 - top_p, the cumulative probability at or under which top-p removes
    min_p: torch.Tensor  # float, 0
    skip: torch.Tensor  # long, 0: the prompt positions the repetition penalty skips (prompt_ignore_length)
    top_k: torch.Tensor  # long, the vocabulary size: k, at least top-k's min_tokens_to_keep, at most the vocabulary
    keep_top_p: torch.Tensor  # long, 1: top-p's min_tokens_to_keep
    keep_min_p: torch.Tensor  # long, 1: min-p's


NEUTRAL = {"repetition": 1.0, "presence": 0.0, "frequency": 0.0, "temperature": 1.0, "top_p_floor": -1.0, "min_p": 0.0}
# each processor's settings, as Settings fields, read from it (transformers' warpers keep top_k already raised to
# min_tokens_to_keep, and the top-p floor is computed in Python's double precision, as TopPLogitsWarper does)
READ = {
    RepetitionPenaltyLogitsProcessor: lambda p: {"repetition": p.penalty, "skip": p.prompt_ignore_length},
    PresencePenaltyLogitsProcessor: lambda p: {"presence": p.presence_penalty},
    FrequencyPenaltyLogitsProcessor: lambda p: {"frequency": p.frequency_penalty},
    TemperatureLogitsWarper: lambda p: {"temperature": p.temperature},
    TopKLogitsWarper: lambda p: {"top_k": p.top_k},
    TopPLogitsWarper: lambda p: {"top_p_floor": 1 - p.top_p, "keep_top_p": p.min_tokens_to_keep},
    MinPLogitsWarper: lambda p: {"min_p": p.min_p, "keep_min_p": p.min_tokens_to_keep},
}


def step_settings(processors, batch: int, vocab: int, device) -> Settings:
    """The settings of `processors` (checked by `check_processors`) as the step's tensors, on `device`: a few copies
    to the device per request, none per token."""
    values = {**NEUTRAL, "skip": None, "top_k": vocab, "keep_top_p": 1, "keep_min_p": 1}
    for processor in processors:
        values.update(READ[type(processor)](processor))
    values["skip"] = 0 if values["skip"] is None else values["skip"]  # None, an int, or one per row (B,)
    values["top_k"] = min(values["top_k"], vocab)

    def column(value, dtype):  # one value, or one per row, as (B, 1)
        return torch.as_tensor(value, dtype=dtype).to(device).reshape(-1, 1).expand(batch, 1).contiguous()

    floats = {name: column(values[name], torch.float32) for name in NEUTRAL}
    longs = {name: column(values[name], torch.long) for name in ("skip", "top_k", "keep_top_p", "keep_min_p")}
    return Settings(**floats, **longs)


def step_mode(processors, do_sample: bool) -> tuple[bool, bool, bool]:
    """The step's three Python values, each a graph of its own: sampling or not, penalties or not, warpers or not.
    Sampling runs both (at their neutral values where unset: one graph for every setting); greedy search runs what
    its processors need, so a plain greedy step stays the forward and an argmax (warpers, which a caller may pass,
    cannot change the argmax but for ties)."""
    warped = do_sample or any(type(processor) in WARPERS for processor in processors)
    return do_sample, warped or any(type(processor) not in WARPERS for processor in processors), warped


def penalise(scores: torch.Tensor, sequence: torch.Tensor, slot: torch.Tensor, settings: Settings) -> torch.Tensor:
    """The repetition, presence and frequency penalties, in that order, over the tokens written before `slot`: the
    operations of their processors (transformers' and `logits_process.py`'s), with the settings as tensors.

    A position that counts for no token (a slot not yet written; for the repetition penalty, a prompt position it
    skips) holds the id V, a column past the vocabulary that is dropped at the end, as transformers' repetition
    penalty drops the padding it skips."""
    vocab = scores.shape[-1]
    positions = torch.arange(sequence.shape[1], device=sequence.device)
    ids = torch.where(positions < slot, sequence, vocab)  # (B, capacity): the tokens so far
    repeated_ids = torch.where(positions >= settings.skip, ids, vocab)
    padded = torch.nn.functional.pad(scores, (0, 1))  # (B, V + 1)
    repeated = padded.gather(1, repeated_ids)
    repeated = torch.where(repeated < 0, repeated * settings.repetition, repeated / settings.repetition)
    padded = padded.scatter(1, repeated_ids, repeated)
    counts = torch.zeros_like(padded).scatter_add_(1, ids, torch.ones_like(ids, dtype=padded.dtype))[:, :vocab]
    scores = padded[:, :vocab] - settings.presence * (counts > 0).to(scores.dtype)
    return scores - settings.frequency * counts


def warp(scores: torch.Tensor, settings: Settings) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p, in that order (generate()'s): the operations of transformers' warpers,
    with the settings as tensors. One sort serves top-k and top-p: the k-th largest score is gathered from it, so k
    is a value in the graph, not a shape, and the sorted scores top-k leaves are the ones top-p would sort."""
    vocab = scores.shape[-1]
    scores = scores / settings.temperature
    ascending, order = torch.sort(scores, descending=False)
    kth = ascending.gather(1, vocab - settings.top_k)  # (B, 1): the k-th largest score
    scores = scores.masked_fill(scores < kth, -float("inf"))
    ascending = ascending.masked_fill(ascending < kth, -float("inf"))
    place = torch.arange(vocab, device=scores.device)  # in the ascending order: the most likely token is last
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    removed = (cumulative <= settings.top_p_floor) & (place < vocab - settings.keep_top_p)
    scores = scores.masked_fill(removed.scatter(1, order, removed), -float("inf"))
    probs = torch.softmax(scores, dim=-1)
    removed = probs < settings.min_p * probs.amax(dim=-1, keepdim=True)
    kept = (place >= vocab - settings.keep_min_p).expand_as(removed)  # min-p's min_tokens_to_keep most likely
    return scores.masked_fill(removed & ~kept.scatter(1, order, kept), -float("inf"))


def process(scores, sequence, slot, settings: Settings, penalised: bool = True, warped: bool = True) -> torch.Tensor:
    """What generate()'s processors make of the scores: the penalties, then the warpers."""
    scores = penalise(scores, sequence, slot, settings) if penalised else scores
    return warp(scores, settings) if warped else scores


def buffers(model, input_ids: torch.LongTensor, length: int) -> tuple[StaticCache, torch.Tensor]:
    """A static cache of at least `length` positions for the batch, emptied, and the sequence buffer the processors
    read (B, capacity). The model keeps both between calls: a compiled step reads them at fixed addresses, so new
    ones would mean recording the graph again."""
    cache = static_cache(model, input_ids.shape[0], length)
    sequence = getattr(cache, "_decode_loop_sequence", None)
    if sequence is None or sequence.device != input_ids.device:
        shape = (input_ids.shape[0], cache._decode_loop_capacity)
        sequence = torch.zeros(shape, dtype=torch.long, device=input_ids.device)
        torch._dynamo.mark_static_address(sequence)  # written in place by the step
        cache._decode_loop_sequence = sequence
    return cache, sequence


def static_cache(model, batch: int, length: int) -> StaticCache:
    """A static cache of at least `length` positions for `batch` rows, emptied, kept on the model between calls."""
    capacity = min(-(-length // CACHE_ROUNDING) * CACHE_ROUNDING, model.config.max_position_embeddings)
    capacity = max(capacity, length)
    cache = getattr(model, "_decode_loop_cache", None)
    reusable = (
        cache is not None
        and cache._decode_loop_capacity == capacity
        and getattr(cache, "_decode_loop_batch", None) == batch
        and getattr(cache, "_decode_loop_dtype", None) == model.dtype
    )
    if reusable:
        cache.reset()
        return cache
    cache = StaticCache(config=model.config, max_cache_len=capacity)
    cache._decode_loop_capacity, cache._decode_loop_batch, cache._decode_loop_dtype = capacity, batch, model.dtype
    model._decode_loop_cache = cache
    return cache


def decode_step(model, settings, mode, token, position, mask, cache, sequence, slot, alive, pad, eos):
    """One new token for every row: the step the loop compiles. `mode` (`step_mode`) is its only Python value:
    sampling is one graph whatever its settings, greedy search one or two (with or without penalties). Every other
    argument but the model is a tensor (or None); none is read back to the host."""
    do_sample, penalised, warped = mode
    # the cache goes fourth, where Deriv's forward takes it under either of its names (transformers 5.24 renamed it)
    outputs = model(token, mask, position, cache, use_cache=True, logits_to_keep=1)
    chosen = choose(process(outputs.logits[:, -1].float(), sequence, slot, settings, penalised, warped), do_sample)
    if eos is not None:
        chosen = torch.where(alive, chosen, pad)  # a finished row repeats the pad token, as generate() writes
        alive = alive & ~torch.isin(chosen, eos)
    sequence.index_copy_(1, slot, chosen[:, None])
    return chosen[:, None], position + 1, alive, slot + 1


def compiled_step(model, loop: str, shape: tuple = ()):
    """The step, compiled once per model and device; uncompiled for "eager" and for a shape past torch's recompile
    limit (`run_steps`)."""
    if loop == "eager" or shape in model.__dict__.get("_decode_loop_uncompiled", ()):
        return decode_step
    steps = model.__dict__.setdefault("_decode_loop_steps", {})  # one per device type the model has been on
    device = model.device.type
    if device not in steps:
        # on a GPU, CUDA graphs: one launch a token. On the CPU, the step's calls into the kernels from C++ rather
        # than Python (inductor's cpp_wrapper): 15 % more tokens/s at the runtimes bench's shape (docs/results.md)
        options = {"mode": "reduce-overhead"} if device == "cuda" else {"options": {"cpp_wrapper": device == "cpu"}}
        steps[device] = torch.compile(decode_step, fullgraph=True, dynamic=False, **options)
    return steps[device]


def recompile_limit_errors() -> tuple[type[BaseException], ...]:
    """What torch raises for a fullgraph function past its recompile limit (the name changed across versions)."""
    names = ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")
    return tuple(error for error in (getattr(torch._dynamo.exc, name, None) for name in names) if error is not None)


def uncompiled_from_now(model, shape: tuple, error: BaseException):
    """After torch refused to compile the step once more for `shape`: the uncompiled step, for this call and every
    later one of that shape (the limit does not reset), said once. The step's other shapes stay compiled."""
    model.__dict__.setdefault("_decode_loop_uncompiled", set()).add(shape)
    logger.warning(
        "decode_loop: torch's recompile limit (torch._dynamo.config.recompile_limit) is reached for the decode step "
        "(%s); calls of this shape (batch, cache, mode, mask, end token, dtype: %s) run it uncompiled from now on",
        type(error).__name__,
        shape,
    )
    return decode_step


def prefill(model, input_ids, model_kwargs, cache):
    """The forward over the prompt into the static cache, uncompiled (as generate() runs it); its last logits."""
    mask, positions = model_kwargs.get("attention_mask"), model_kwargs.get("position_ids")
    outputs = model(input_ids, mask, positions, cache, use_cache=True, logits_to_keep=1)
    return outputs.logits[:, -1].float()


def choose(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """The next token of each row from its processed scores: the argmax, or a sample of softmax(scores)."""
    if not do_sample:
        return torch.argmax(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    # the exponential race: argmax p_i / E_i with E_i ~ Exp(1) independent picks i with probability p_i
    return torch.argmax(probs / torch.empty_like(probs).exponential_(1), dim=-1)


def loop_state(input_ids, model_kwargs, sequence: torch.Tensor):
    """The fixed-shape tensors the step reads: the position of the next token, the padding mask over the whole
    cache (None when there is no padding), and the sequence buffer the processors see, filled in."""
    capacity = sequence.shape[1]
    batch, length = input_ids.shape
    positions = model_kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=input_ids.device).expand(batch, length)
    mask = model_kwargs.get("attention_mask")
    if mask is not None:  # (B, capacity): the prompt's padding, then ones (later slots are hidden by the causal mask)
        mask = torch.cat([mask, mask.new_ones(batch, capacity - length)], dim=1)
    sequence.zero_()  # the slots not yet written count for no token (`penalise` masks them)
    sequence[:, :length] = input_ids
    return positions[:, -1:] + 1, mask


def decode_loop(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer=None,
    loop: str = "compiled",
    loop_streamer=None,
    **model_kwargs,
):
    """generate()'s greedy search and sampling, with the whole decode step compiled; a `custom_generate` for
    `model.generate(...)` (which prepares the processors, the criteria and the lengths and then calls this).

    subtle: generate() hands a custom_generate callable none of its own `streamer`, `synced_gpus` or `assistant_model`
    (transformers 5.24 keeps only the callable's extra arguments), so `DerivForCausalLM.generate` passes the streamer
    as `loop_streamer`, which has not seen the prompt yet (it sees it once the request is accepted, so a caller may
    run a refused request with generate() and the same streamer); a `streamer` (from a transformers that passes it)
    has."""
    from transformers.generation.utils import GenerateDecoderOnlyOutput

    if synced_gpus:
        raise unsupported("synced_gpus (DeepSpeed ZeRO-3 / FSDP generation)")
    check_request(model, generation_config, logits_processor, stopping_criteria, model_kwargs)
    batch, length = input_ids.shape
    new_tokens = generation_config.max_length - length
    if generation_config.max_length > model.config.max_position_embeddings:
        raise ValueError(
            f"Position {model.config.max_position_embeddings} is past the end of the position table "
            f"(max_position_embeddings={model.config.max_position_embeddings}): the prompt ({length} tokens) and "
            f"max_new_tokens ({new_tokens}) are longer than the model's context; truncate the input or lower "
            "max_new_tokens."
        )
    if loop_streamer is not None:
        loop_streamer.put(input_ids.cpu())
        streamer = loop_streamer
    cache, sequence = buffers(model, input_ids, generation_config.max_length)
    position, mask = loop_state(input_ids, model_kwargs, sequence)
    device = input_ids.device
    eos = generation_config._eos_token_tensor
    has_eos = eos is not None and any(isinstance(c, EosTokenCriteria) for c in stopping_criteria)
    eos = eos.to(device).reshape(-1) if has_eos else None
    pad = generation_config._pad_token_tensor
    pad = (pad if pad is not None else torch.tensor(0)).to(device)
    do_sample = bool(generation_config.do_sample)
    settings = step_settings(logits_processor, batch, model.config.vocab_size, device)
    sampling = (settings, step_mode(logits_processor, do_sample))

    with torch.no_grad():
        logits = prefill(model, input_ids, model_kwargs, cache)
        slot = torch.tensor([length], device=device)
        chosen = choose(process(logits, sequence, slot, *sampling), do_sample)
        alive = torch.ones(batch, dtype=torch.bool, device=device)
        if eos is not None:
            alive = alive & ~torch.isin(chosen, eos)
        sequence.index_copy_(1, slot, chosen[:, None])
        token, slot = chosen[:, None], slot + 1
        state = (token, position, mask, cache, sequence, slot, alive, pad, eos)
        stops = [criterion for criterion in stopping_criteria if checked_every_block(criterion)]
        produced = run_steps(model, loop, sampling, state, (length, new_tokens), streamer, stops)
    output = sequence[:, : length + produced]
    if streamer is not None:
        streamer.end()
    if generation_config.return_dict_in_generate:
        fields = GenerateDecoderOnlyOutput.__dataclass_fields__  # the cache's name: `cache` from transformers 5.24
        return GenerateDecoderOnlyOutput(
            sequences=output, **{"cache" if "cache" in fields else "past_key_values": cache}
        )
    return output


def step_shape(model, sampling, state) -> tuple:
    """What compiles the step again when it changes (beside the model and the device): shapes, modes, dtype."""
    mask, sequence, eos = state[2], state[4], state[8]
    return (model.device.type, *sequence.shape, *sampling[1], mask is None, eos is None, model.dtype)


def run_steps(model, loop, sampling, state, lengths, streamer, stops=()) -> int:
    """Run the step until `new_tokens` tokens exist, every row has ended (asked every CHECK_EVERY tokens) or a
    block-checked criterion (`stops`) says stop; the number of new tokens kept: generate() stops at the step where
    the last row ends."""
    shape = step_shape(model, sampling, state)
    step = compiled_step(model, loop, shape)
    token, position, mask, cache, sequence, slot, alive, pad, eos = state
    length, new_tokens = lengths
    history = [alive.clone()]  # alive after each new token
    done = 1
    streamed = put_tokens(streamer, sequence, length, 0, 1)  # the first token at once: the time to first token
    while done < new_tokens and (eos is None or bool(alive.any())):  # the host's one read per CHECK_EVERY tokens
        if any(bool(stop(sequence[:, : length + done], None).all()) for stop in stops):
            break
        for _ in range(min(CHECK_EVERY, new_tokens - done)):
            arguments = (model, *sampling, token, position, mask, cache, sequence, slot, alive, pad, eos)
            try:
                outputs = step(*arguments)
            except recompile_limit_errors() as error:  # raised before the step ran: nothing is written yet
                step = uncompiled_from_now(model, shape, error)
                outputs = step(*arguments)
            # subtle: under CUDA graphs a step's outputs live in memory the next replay overwrites; clones keep them
            token, position, alive, slot = (t.clone() for t in outputs)
            history.append(alive)
            done += 1
        if eos is None or bool(alive.any()):
            streamed = put_tokens(streamer, sequence, length, streamed, done)
    produced = keep_until_last_end(history, eos)
    put_tokens(streamer, sequence, length, streamed, produced)
    return produced


def put_tokens(streamer, sequence: torch.Tensor, length: int, start: int, stop: int) -> int:
    """Hand the streamer new tokens start..stop-1, one `put` of a (B,) tensor per token, as generate() does."""
    if streamer is not None and stop > start:
        for column in sequence[:, length + start : length + stop].cpu().unbind(dim=1):
            streamer.put(column)
    return max(start, stop)


def keep_until_last_end(history: list[torch.Tensor], eos) -> int:
    """How many new tokens generate() would have returned: all of them, or up to the one that ended the last row."""
    if eos is None:
        return len(history)
    still = torch.stack(history).any(dim=1).tolist()  # any row alive after token i
    return next((i + 1 for i, going in enumerate(still) if not going), len(history))
