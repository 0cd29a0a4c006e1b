"""How `deriv serve` decodes: one request at a time with `generate()`, or many at once with transformers'
continuous batching. Either way a request is a `Job` whose new token ids arrive on an asyncio queue, so the HTTP
layer streams and stops the same way over both.

- `GenerateEngine`: one worker thread runs `model.generate()` for one request at a time, with the request's own
  sampling settings, seed and penalties. The reply is exactly what `generate()` gives for the same prompt. Under
  `--decode-loop` it runs Deriv's decode loop, whose one compiled step takes every request's settings as inputs; a
  request the loop refuses (`DecodeLoopUnsupported`, before it decodes anything) runs in `generate()`'s own loop
  instead, said in one log line: a setting is never a failed request.
- `BatchingEngine`: transformers' `ContinuousBatchingManager` packs every request in flight into one batch over a
  paged KV cache. It decodes with one generation config for the whole batch (the folder's), so a request may
  choose its length and stop sequences but not its own sampling (`app.py` refuses those). If its worker thread
  dies, the requests it held fail and a fresh worker starts: one request can fail, never the server.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor


logger = logging.getLogger("deriv_lm.serve")

END = "end"  # the last item on a job's queue when decoding finished (a JobFailed instead when it failed)


class JobFailed(Exception):
    """Decoding failed inside the engine (not the request's fault: the request was valid)."""


class Job:
    """One request's decoding: the prompt's ids in, lists of new token ids out on `queue`, then END or JobFailed."""

    def __init__(self, prompt: list[int], max_new_tokens: int, token_by_token: bool = True):
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens
        # False when the reply is wanted whole (no stream, no stop sequence): the batching engine then hands over
        # the tokens once, at the end, instead of waking the event loop at every step of every request
        self.token_by_token = token_by_token
        self.queue: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.cancelled = threading.Event()
        self.request_id: str | None = None

    def push(self, item) -> None:
        """Hand `item` to the event loop (from any thread)."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class GenerateEngine:
    """`generate()` on one worker thread, one request after another: each reply is `generate()`'s own."""

    batching = False

    def __init__(self, model, generation_config):
        self.model = model
        self.generation_config = generation_config
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="deriv-generate")

    def run_on_worker(self, function, *args):
        """`function(*args)` on the thread that runs every request, waited for; its result or its exception."""
        return self._pool.submit(function, *args).result()

    def submit(self, job: Job, sampling: dict, seed: int | None = None, processors=None) -> None:
        """Queue `job`; `sampling` holds GenerationConfig fields (do_sample, temperature, top_p), `processors` the
        presence and frequency penalties."""
        self._pool.submit(self._run, job, sampling, seed, processors)

    def _run(self, job: Job, sampling: dict, seed: int | None, processors) -> None:
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        from ..modeling_deriv.decode_loop import DecodeLoopUnsupported

        class Cancelled(StoppingCriteria):
            checked_every_block = True  # the decode loop (--decode-loop) asks every few tokens, not every one

            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), job.cancelled.is_set(), dtype=torch.bool)

        if job.cancelled.is_set():  # the client left while the request waited its turn
            job.push(END)
            return
        try:
            config = copy.deepcopy(self.generation_config)
            config.update(max_new_tokens=job.max_new_tokens, **sampling)
            criteria = StoppingCriteriaList([Cancelled()])
            try:
                self._generate(job, config, seed, processors, criteria)
            except DecodeLoopUnsupported as refusal:  # raised before the loop decoded or streamed anything
                logger.warning("deriv serve: generate() runs this request, not the decode loop: %s", refusal)
                config.decode_loop = None
                self._generate(job, config, seed, processors, criteria)
        except Exception as error:  # a bug, since the request was validated: log it whole, fail this request
            logger.exception("generate() failed on a validated request of %d prompt tokens", len(job.prompt))
            job.push(JobFailed(f"generation failed: {type(error).__name__}"))
            return
        job.push(END)

    def _generate(self, job: Job, config, seed: int | None, processors, criteria) -> None:
        """`generate()` for the job with `config` (the seed set first, so a reply depends on it alone)."""
        import torch

        if seed is not None:
            torch.manual_seed(seed)
        input_ids = torch.tensor([job.prompt], device=self.model.device)
        with torch.no_grad():
            self.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=config,
                logits_processor=processors,
                stopping_criteria=criteria,
                streamer=_TokenStreamer(job),
            )

    def cancel(self, job: Job) -> None:
        job.cancelled.set()

    def alive(self) -> str | None:
        """None while the engine can take requests, else why not."""
        return None

    async def watch(self) -> None:
        return None

    def stop(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class _TokenStreamer:
    """`generate()`'s streamer protocol: the first `put` is the prompt (skipped), then each new token."""

    def __init__(self, job: Job):
        self.job = job
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.job.push(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


# Generation settings whose logits processors transformers' continuous batching does not run
# (`supports_continuous_batching = False`), with the values that leave the processor out (the first is set). Left
# set, every request logs "Processor ... isn't supported by CB. Dropping it." and runs without it anyway.
CB_UNSUPPORTED = {"repetition_penalty": (None, 1.0), "min_length": (0, None), "min_new_tokens": (None, 0)}


def without_unsupported_settings(generation_config):
    """A copy of `generation_config` without the settings continuous batching cannot apply, said once, at start
    (the folders' own generation config sets repetition_penalty)."""
    config = copy.deepcopy(generation_config)
    dropped = []
    for name, off in CB_UNSUPPORTED.items():
        if getattr(config, name, off[0]) not in off:
            dropped.append(f"{name}={getattr(config, name)}")
            setattr(config, name, off[0])
    if dropped:
        logger.warning(
            "deriv serve: continuous batching does not apply %s from the folder's generation config; serving "
            "without it (without --continuous-batching it applies)",
            ", ".join(dropped),
        )
    return config


class BatchingEngine:
    """transformers' continuous batching, restarted if its worker dies; one generation config for all."""

    batching = True

    def __init__(self, model, generation_config, batching_config):
        self.model = model
        self.generation_config = without_unsupported_settings(generation_config)
        self.batching_config = batching_config
        self.jobs: dict[str, Job] = {}
        self.restarts = 0
        self._stopping = False
        self._start()

    def _start(self) -> None:
        self.manager = self.model.init_continuous_batching(
            generation_config=self.generation_config, continuous_batching_config=copy.copy(self.batching_config)
        )
        self.manager.start()

    def submit(self, job: Job, sampling: dict | None = None, seed: int | None = None, processors=None) -> None:
        """Queue `job` (on the event loop's thread). Sampling is the folder's: `app.py` refuses other settings."""
        job.request_id = request_id = f"deriv-{uuid.uuid4().hex}"
        self.jobs[request_id] = job
        sent = 0

        def on_output(output) -> None:  # called on the event loop: per new token, or once at the end
            nonlocal sent
            new = output.generated_tokens[sent:]
            sent = len(output.generated_tokens)
            if new:
                job.queue.put_nowait(list(new))
            if output.error is not None:
                self.jobs.pop(request_id, None)
                job.queue.put_nowait(JobFailed(f"generation failed: {output.error}"))
            elif output.is_finished():
                self.jobs.pop(request_id, None)
                job.queue.put_nowait(END)

        self.manager.register_result_handler(request_id, on_output)
        accepted = self.manager.add_request(
            job.prompt,
            request_id=request_id,
            max_new_tokens=job.max_new_tokens,
            streaming=job.token_by_token,
            eos_token_id=self.generation_config.eos_token_id,
        )
        if accepted is None:  # the manager is stopping or restarting: it dropped the request
            self.cancel(job)
            job.queue.put_nowait(JobFailed("the batching worker is restarting; retry the request"))

    def cancel(self, job: Job) -> None:
        if job.request_id is None or self.jobs.pop(job.request_id, None) is None:
            return
        job.cancelled.set()
        self.manager.cancel_request(job.request_id)
        # subtle: a cancelled request gets no final output, so the manager would keep its handler for good
        router = getattr(self.manager, "output_router", None)
        if router is not None:
            with router._lock:
                router.result_handlers.pop(job.request_id, None)

    def alive(self) -> str | None:
        error = self.manager.background_thread_status.fatal_error
        if error is not None:
            return f"the batching worker failed ({type(error).__name__}); it is being restarted"
        if not self.manager.is_running() and not self._stopping:
            return "the batching worker is not running; it is being restarted"
        return None

    async def watch(self, every: float = 0.25) -> None:
        """Runs on the event loop for the server's life: a dead worker fails the requests it held and is replaced."""
        while not self._stopping:
            await asyncio.sleep(every)
            reason = self.alive()
            if reason is None or self._stopping:
                continue
            logger.error("deriv serve: %s", reason)
            held, self.jobs = self.jobs, {}
            for job in held.values():
                job.queue.put_nowait(JobFailed("generation failed: the batching worker stopped"))
            await asyncio.to_thread(self._restart)

    def _restart(self) -> None:
        try:
            self.manager.stop(block=True, timeout=10, hard_stop=True)
        except Exception:  # the old worker is gone either way; the new one is what matters
            logger.warning("deriv serve: the failed batching worker did not stop cleanly", exc_info=True)
        self._start()
        self.restarts += 1

    def stop(self) -> None:
        self._stopping = True
        self.manager.stop(block=True, timeout=10)
