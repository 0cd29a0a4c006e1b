"""Stopping a run cleanly: SIGTERM / SIGINT, and a loss that is no longer a number."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager, nullcontext


class TrainingInterrupted(Exception):
    """The process was asked to stop (SIGTERM / SIGINT): in the loop after saving a checkpoint, elsewhere at once."""


class NonFiniteLoss(Exception):
    """The training loss became inf or nan; the run stops with its last good checkpoint in place."""


class StopRequests:
    """Where SIGTERM and SIGINT go during a run. In the training loop (`defer`) they are noted, and the loop saves
    a checkpoint at the end of the step and stops. Anywhere else (data preparation, export) they stop the run at
    once: every folder is written atomically, so a stop there leaves each as it was."""

    def __init__(self):
        self.defer = False
        self.received: str | None = None
        self.phase = "before training"

    def __call__(self, signum, frame):
        name = signal.Signals(signum).name
        if self.defer:
            self.received = name
            return
        raise TrainingInterrupted(f"{name} received {self.phase}: stopped; no folder was left half-written")


STOP = StopRequests()


def _default_stops_in_a_child() -> None:
    """A process forked during a run (a `datasets.map(num_proc=...)` worker) dies on SIGTERM, as its pool expects:
    `STOP` is the run's handler, and a Python handler never runs while the worker waits in the pool's semaphore."""
    if signal.getsignal(signal.SIGTERM) is STOP:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


os.register_at_fork(after_in_child=_default_stops_in_a_child)


@contextmanager
def handle_stop_signals():
    """Route SIGTERM and SIGINT to `STOP` for the duration (the `deriv train` commands wrap the whole run)."""
    previous = {s: signal.signal(s, STOP) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        STOP.defer, STOP.received, STOP.phase = False, None, "before training"
        for s, h in previous.items():
            signal.signal(s, h)


@contextmanager
def deferred_stop():
    """In the loop a stop request waits for the end of the step; outside `deriv train` (the Python API) the
    handlers are installed for the loop alone."""
    installed = signal.getsignal(signal.SIGTERM) is STOP
    with nullcontext() if installed else handle_stop_signals():
        STOP.defer, STOP.received = True, None
        try:
            yield
        finally:
            STOP.defer = False
