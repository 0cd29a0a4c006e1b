"""Batch-1 decode near the hardware: one compiled step (forward, logits processors, token choice) per token.

    model.generate(ids, max_new_tokens=256, decode_loop="compiled")          # Deriv's switch
    model.generate(ids, max_new_tokens=256, custom_generate=decode_loop)     # transformers' hook, the same loop
    model.generation_config.decode_loop = "compiled"                          # every generate() of this model

Why a loop of our own: `generate()` runs Python between forwards on every token: it grows the id tensor and the
mask, calls each logits processor and stopping criterion, and reads flags back from the device. With a static cache
transformers compiles the forward alone, so each token is still one graph plus dozens of small launches and a few
host synchronisations. Here everything a step does lives in one function, compiled once (CUDA graphs on a GPU,
`mode="reduce-overhead"`), whose inputs and outputs are tensors of fixed shape:

    token (B, 1), position (B, 1), alive (B,), slot ()  ->  forward over the static cache
                                                         ->  processors(sequence buffer, logits)
                                                         ->  argmax, or a sample
                                                         ->  next token, next position, alive, slot + 1

The host reads nothing back per token: the end-of-sequence test runs on the device (`alive`), and the host asks
whether any row is still alive only every `check_every` tokens. Tokens after a row's end are `pad_token_id`, and
the output is cut where the last row ended, so the result is `generate()`'s: the same tokens for greedy search, the
same distribution for sampling (drawn as argmax(p / E) with E ~ Exp(1), the exponential race, which samples from p
exactly and, unlike `torch.multinomial`, can live inside a CUDA graph; the random numbers differ from
`generate()`'s).

What it runs is narrower than `generate()`, and it says so instead of differing silently: greedy search and
sampling (no beams, no assistant), the processors in `SUPPORTED_PROCESSORS`, stopping at `max_new_tokens` and at
end-of-sequence, decoder-only models, ids as input, and no per-step outputs (scores, attentions). The sequence the
processors see is a buffer of fixed length: the prompt, the tokens so far, and copies of the prompt's first token in
the slots not yet written, which changes nothing for the supported processors (a repeated token is penalised once).
`decode_loop="eager"` runs the same step uncompiled: the loop's logic without the compiler, for tests and where
torch.compile is not available.
"""

from __future__ import annotations

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

from .logits_process import PresencePenaltyLogitsProcessor


LOOPS = ("compiled", "eager")
# processors whose result depends on the set of ids in the sequence at most, never on its length or order
SUPPORTED_PROCESSORS = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    PresencePenaltyLogitsProcessor,
)
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
        "min-p, repetition and presence penalties. Leave decode_loop unset to use generate()'s own loop."
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
    for processor in processors:
        if not isinstance(processor, SUPPORTED_PROCESSORS):
            raise unsupported(f"the logits processor {type(processor).__name__}")
        if isinstance(processor, RepetitionPenaltyLogitsProcessor) and processor.prompt_ignore_length is not None:
            raise unsupported("repetition_penalty with prompt_ignore_length")
    for criterion in criteria:
        if not isinstance(criterion, (MaxLengthCriteria, EosTokenCriteria)) and not checked_every_block(criterion):
            raise unsupported(f"the stopping criterion {type(criterion).__name__}")
    if model_kwargs.get("inputs_embeds") is not None:
        raise unsupported("inputs_embeds (pass input_ids)")
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    if cache is not None and getattr(cache, "_is_user_defined", False):
        raise unsupported("a cache passed in by the caller")


def checked_every_block(criterion) -> bool:
    """A stopping criterion that ends the whole request from the host (a client that left, a deadline) says so with
    `checked_every_block = True`; the loop asks it every CHECK_EVERY tokens instead of every token."""
    return getattr(criterion, "checked_every_block", False)


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


def decode_step(model, processors, do_sample, token, position, mask, cache, sequence, slot, alive, pad, eos):
    """One new token for every row: the step the loop compiles. All arguments but the first three are tensors (or
    None); none is read back to the host."""
    # the cache goes fourth, where Deriv's forward takes it under either of its names (transformers 5.24 renamed it)
    outputs = model(token, mask, position, cache, use_cache=True, logits_to_keep=1)
    chosen = choose(processors(sequence, outputs.logits[:, -1].float()), do_sample)
    if eos is not None:
        chosen = torch.where(alive, chosen, pad)  # a finished row repeats the pad token, as generate() writes
        alive = alive & ~torch.isin(chosen, eos)
    sequence.index_copy_(1, slot, chosen[:, None])
    return chosen[:, None], position + 1, alive, slot + 1


def compiled_step(model, loop: str):
    """The step, compiled once per model (transformers' processors are inlined and guarded on their settings: a new
    temperature or top-k compiles the step again)."""
    if loop == "eager":
        return decode_step
    steps = model.__dict__.setdefault("_decode_loop_steps", {})  # one per device type the model has been on
    device = model.device.type
    if device not in steps:
        # on a GPU, CUDA graphs: one launch a token. On the CPU, the step's calls into the kernels from C++ rather
        # than Python (inductor's cpp_wrapper): 15 % more tokens/s at the runtimes bench's shape (docs/results.md)
        options = {"mode": "reduce-overhead"} if device == "cuda" else {"options": {"cpp_wrapper": device == "cpu"}}
        steps[device] = torch.compile(decode_step, fullgraph=True, dynamic=False, **options)
    return steps[device]


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
    sequence.copy_(input_ids[:, :1].expand(batch, capacity))  # unwritten slots repeat a token the prompt has
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
    as `loop_streamer`, which has not seen the prompt yet; a `streamer` (from a transformers that passes it) has."""
    if loop_streamer is not None:
        loop_streamer.put(input_ids.cpu())
        streamer = loop_streamer
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
    cache, sequence = buffers(model, input_ids, generation_config.max_length)
    position, mask = loop_state(input_ids, model_kwargs, sequence)
    device = input_ids.device
    eos = generation_config._eos_token_tensor
    has_eos = eos is not None and any(isinstance(c, EosTokenCriteria) for c in stopping_criteria)
    eos = eos.to(device).reshape(-1) if has_eos else None
    pad = generation_config._pad_token_tensor
    pad = (pad if pad is not None else torch.tensor(0)).to(device)
    do_sample = bool(generation_config.do_sample)

    with torch.no_grad():
        logits = prefill(model, input_ids, model_kwargs, cache)
        chosen = choose(logits_processor(sequence, logits), do_sample)
        alive = torch.ones(batch, dtype=torch.bool, device=device)
        if eos is not None:
            alive = alive & ~torch.isin(chosen, eos)
        slot = torch.tensor([length], device=device)
        sequence.index_copy_(1, slot, chosen[:, None])
        token, slot = chosen[:, None], slot + 1
        state = (token, position, mask, cache, sequence, slot, alive, pad, eos)
        stops = [criterion for criterion in stopping_criteria if checked_every_block(criterion)]
        produced = run_steps(model, loop, logits_processor, do_sample, state, (length, new_tokens), streamer, stops)
    output = sequence[:, : length + produced]
    if streamer is not None:
        streamer.end()
    if generation_config.return_dict_in_generate:
        fields = GenerateDecoderOnlyOutput.__dataclass_fields__  # the cache's name: `cache` from transformers 5.24
        return GenerateDecoderOnlyOutput(
            sequences=output, **{"cache" if "cache" in fields else "past_key_values": cache}
        )
    return output


def run_steps(model, loop, processors, do_sample, state, lengths, streamer, stops=()) -> int:
    """Run the step until `new_tokens` tokens exist, every row has ended (asked every CHECK_EVERY tokens) or a
    block-checked criterion (`stops`) says stop; the number of new tokens kept: generate() stops at the step where
    the last row ends."""
    step = compiled_step(model, loop)
    token, position, mask, cache, sequence, slot, alive, pad, eos = state
    length, new_tokens = lengths
    history = [alive.clone()]  # alive after each new token
    done = 1
    streamed = put_tokens(streamer, sequence, length, 0, 1)  # the first token at once: the time to first token
    while done < new_tokens and (eos is None or bool(alive.any())):  # the host's one read per CHECK_EVERY tokens
        if any(bool(stop(sequence[:, : length + done], None).all()) for stop in stops):
            break
        for _ in range(min(CHECK_EVERY, new_tokens - done)):
            # subtle: under CUDA graphs a step's outputs live in memory the next replay overwrites; clones keep them
            outputs = step(model, processors, do_sample, token, position, mask, cache, sequence, slot, alive, pad, eos)
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
