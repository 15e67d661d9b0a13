"""Fixed torch thread counts, so a stage's arithmetic depends on its parameters, never on the machine.

Reductions split across threads add in a different order, so the same stage run with 1 or 2 intra-op threads
gives results that differ in the last bits. Every stage therefore runs under an explicit count: the flow's stages
under `compute.torch_threads`, every Dask task under 1. torch's count is process-wide, so contexts open at once in
several threads (tasks on a multi-threaded worker, or `in_threads` here) must agree on it; the count from before the
first one is restored after the last one.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

TASK_THREADS = 1  # every Dask task: parallelism comes from workers, and results match the sequential cluster

_lock = threading.Lock()
_open: list[tuple[int, int]] = []  # (thread id, count) of the contexts now open, innermost last
_outside = 0
T = TypeVar("T")


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the body with exactly `n` torch intra-op threads. Contexts nest within a thread; contexts open at once
    in other threads of this process must ask for the same count (a thread's innermost one), or this refuses to start."""
    global _outside
    me = threading.get_ident()
    with _lock:
        innermost = {thread: count for thread, count in _open}  # later entries are inner
        others = {count for thread, count in innermost.items() if thread != me}
        if others - {n}:
            raise RuntimeError(f"torch is pinned to {others} threads by a concurrent stage in this process; {n} were asked for")
        if not _open:
            _outside = torch.get_num_threads()
        _open.append((me, n))
        torch.set_num_threads(n)
    try:
        yield
    finally:
        with _lock:
            del _open[max(i for i, entry in enumerate(_open) if entry == (me, n))]
            torch.set_num_threads(_open[-1][1] if _open else _outside)


def in_threads(fn: Callable[..., T], calls: Sequence[tuple[Any, ...]], threads: int) -> Iterator[T]:
    """fn(*call) for every call, in call order, on `threads` threads of this process under TASK_THREADS torch
    threads each: what a local cluster's single-threaded workers compute, the same bits, without starting them. At
    most 2·threads results wait to be taken; what is left is cancelled when the caller stops early. fn must not share
    a torch module between calls (each task loads its own)."""
    with torch_threads(TASK_THREADS):
        if threads <= 1:
            yield from (fn(*call) for call in calls)
            return
        pool = ThreadPoolExecutor(threads, thread_name_prefix="task")
        waiting: deque[Future[T]] = deque()
        try:
            for call in calls:
                waiting.append(pool.submit(_pinned, fn, call))
                if len(waiting) >= 2 * threads:
                    yield waiting.popleft().result()
            while waiting:
                yield waiting.popleft().result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _pinned(fn: Callable[..., T], call: tuple[Any, ...]) -> T:
    """fn(*call) on a pool thread, under the count the calling thread holds."""
    with torch_threads(TASK_THREADS):
        return fn(*call)
