"""The query factors of a scoring stage kept in the flow's process are read once for all its threads, and not kept
after the last thread lets them go."""

from __future__ import annotations

import gc
import threading
import time

import torch

from influence_core.pipeline.score.chunks import _Shared


def test_threads_asking_at_once_share_one_read_and_it_goes_with_them():
    shared, reads = _Shared(), []

    def read() -> torch.Tensor:
        reads.append(threading.get_ident())
        time.sleep(0.05)  # the other threads ask while this read is under way
        return torch.arange(6.0)

    start = threading.Barrier(4)
    got: list[torch.Tensor] = []

    def worker() -> None:
        start.wait()
        got.append(shared.get("factors.zarr#abc", read))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reads) == 1 and len(got) == 4
    assert all(value is got[0] for value in got)
    assert torch.equal(got[0], torch.arange(6.0))
    got.clear()
    gc.collect()
    assert torch.equal(shared.get("factors.zarr#abc", read), torch.arange(6.0)) and len(reads) == 2  # read anew
    assert shared.get("factors.zarr#other", lambda: torch.zeros(2)).tolist() == [0.0, 0.0]  # another key, its own read
