"""The cache's prefetch: values moved up to the device tier on a background thread, one at a
time under the cache's lock, so that a later get finds them there."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor

from vramctl.cache._disk import CorruptItemError
from vramctl.cache._mover import Mover

__all__ = ["Prefetcher"]

log = logging.getLogger("vramctl.cache")


class Prefetcher:
    """Moves values up through ``mover`` on its own thread (started on first use), each
    under ``lock``."""

    def __init__(self, mover: Mover, lock: threading.RLock) -> None:
        self.mover = mover
        self.lock = lock
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, keys: list[Hashable]) -> Future[int]:
        """Start moving ``keys``' values to the device tier; a future of how many moved."""
        with self.lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="vramctl-cache")
            return self._executor.submit(self._prefetch, keys)

    def close(self) -> None:
        """Wait for the thread's work, and stop it."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _prefetch(self, keys: list[Hashable]) -> int:
        mover, ledger = self.mover, self.mover.ledger
        device = mover.io.device
        moved = 0
        with contextlib.ExitStack() as stack:
            if device.is_simulated:
                stack.enter_context(device.counting())
            for key in keys:
                with self.lock:
                    entry = ledger.entries.get(key)
                    if entry is None or entry.tier == "gpu" or not ledger.budget["gpu"]:
                        continue
                    try:
                        if mover.promote(entry):
                            moved += 1
                    except CorruptItemError as exc:  # dropped already: the others go on
                        log.error("prefetch of %r: %s", key, exc)
        return moved
