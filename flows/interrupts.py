"""SIGINT, SIGTERM and SIGHUP stop a CLI run cleanly: the run unwinds (Prefect marks it crashed, the Dask cluster
closes), every process the run started (the temporary Prefect server, Dask nannies and workers) is ended, and the
command exits 128 + the signal's number, never 0.

Without this, SIGTERM ends Python without unwinding: Prefect's SIGTERM bridge raises `TerminationSignal`, then
re-sends SIGTERM to the default handler, so `atexit`, which stops the temporary server, never runs and the server
is orphaned. A signal whose exception is swallowed (raised inside a finaliser: "Exception ignored ...") is still
seen through the wakeup fd, so an interrupted run never reports success. So is one taken by another handler: during
a flow run, Prefect's SIGTERM bridge replaces ours, and its `TerminationSignal` can be swallowed the same way; the
stage boundaries read the wakeup fd, so such a run stops before it publishes.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

import psutil

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GRACE_SECONDS = 5.0  # how long the processes the run started get to exit after SIGTERM, before SIGKILL


class Interrupted(BaseException):
    """The run was stopped by a signal; a BaseException, like KeyboardInterrupt, so no `except Exception` eats it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _Received:
    """The signals seen so far; only the first raises, so a second Ctrl-C does not break the clean-up. `wake_fd`
    holds every signal's number as well, whichever handler took it (Prefect's SIGTERM bridge, during a flow run)."""

    def __init__(self, wake_fd: int) -> None:
        self.signals: list[int] = []
        self.written: list[int] = []
        self.wake_fd = wake_fd

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.signals.append(signum)
        if len(self.signals) == 1:
            raise Interrupted(signum)

    def first(self) -> int | None:
        """The first signal seen, by our handler or through the wakeup fd; None when there was none."""
        self.written += _drain(self.wake_fd)
        seen = self.signals or self.written
        return seen[0] if seen else None


_ACTIVE: list[_Received] = []  # the signals seen by the innermost `interruptible` block


def raise_if_interrupted() -> None:
    """Between stages: a signal whose exception was swallowed mid-stage (raised inside a finaliser, or in a callback
    that catches everything) still stops the run here, before the next stage or the publish, so an interrupted run
    never goes on to look complete. Outside an `interruptible` block (a worker's flow run), nothing to check."""
    signum = _ACTIVE[-1].first() if _ACTIVE else None
    if signum is not None:
        raise Interrupted(signum)


@contextmanager
def interruptible(before_stop: Callable[[], object] = lambda: None) -> Iterator[None]:
    """Run the block so that SIGINT, SIGTERM or SIGHUP raise `Interrupted`, and on the way out call `before_stop`
    (e.g. send the last logs to the API server), then end every process started inside it that is still alive.
    Only in the main thread (signal handlers live there)."""
    me = psutil.Process()
    before = {child.pid for child in me.children(recursive=True)}  # not ours to stop (e.g. a test's own cluster)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    received = _Received(wake_read)
    _ACTIVE.append(received)
    previous = {signum: signal.signal(signum, received) for signum in SIGNALS}
    previous_wakeup = signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    try:
        yield
        signum = received.first()
        if signum is not None:
            raise Interrupted(signum)
    except Interrupted:
        try:
            before_stop()
        finally:
            stop_started(me, before)
        raise
    finally:
        _ACTIVE.remove(received)
        signal.set_wakeup_fd(previous_wakeup)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        os.close(wake_read)
        os.close(wake_write)


def _drain(fd: int) -> list[int]:
    """The numbers of the signals of SIGNALS written to the wakeup fd so far."""
    seen = b""
    while True:
        try:
            chunk = os.read(fd, 512)
        except BlockingIOError:
            break
        if not chunk:
            break
        seen += chunk
    return [signum for signum in seen if signum in SIGNALS]


def stop_started(me: psutil.Process, before: set[int]) -> None:
    """SIGTERM to every descendant not in `before`, SIGKILL to those still alive after GRACE_SECONDS."""
    started = [child for child in me.children(recursive=True) if child.pid not in before]
    for child in started:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(started, timeout=GRACE_SECONDS)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(alive, timeout=GRACE_SECONDS)
