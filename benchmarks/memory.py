"""Peak resident memory of this process and all its children (Dask workers included), sampled in a thread."""

from __future__ import annotations

import threading
import time

import psutil


class PeakRSS:
    """Context manager: `.peak` is the largest summed RSS of the process tree seen while it was open."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval, self.peak = interval, 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        root = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for proc in [root, *root.children(recursive=True)]:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    continue
            self.peak = max(self.peak, total)
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
